"""NodeRegistry (workflows/nodes.py) on the real dev server: announcements are the nodes'
liveness, stamped with the registry's clock; a leaving node is gone at once; malformed
input is dropped without failing the registry."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from temporalio.client import Client
from temporalio.worker import Worker

from activities.contracts import ANNOUNCE, LEAVE, NodeInfo
from workflows.nodes import NodeRegistry


def test_the_registry_keeps_each_nodes_last_announcement_forgets_a_leaving_one_and_drops_junk(
        temporal_server):
    async def go():
        client = await Client.connect(temporal_server.address)
        queue, wid = f"nodes-{uuid.uuid4().hex[:8]}", f"registry-{uuid.uuid4().hex[:8]}"
        a = NodeInfo(name="a", queue="q@a", address="10.0.0.2", rdzv_port=29400, procs=8, gpus=8)
        b = dataclasses.replace(a, name="b", queue="q@b", address="10.0.0.3")
        async with Worker(client, task_queue=queue, workflows=[NodeRegistry]):
            async def announce(info):  # what a worker does (ops/worker.py)
                await client.start_workflow(NodeRegistry.run, None, id=wid, task_queue=queue,
                                            start_signal=ANNOUNCE,
                                            start_signal_args=[dataclasses.asdict(info)])
            before = time.time()
            await announce(a)
            await announce(b)
            await announce(dataclasses.replace(a, busy="run-1 0-100"))
            handle = client.get_workflow_handle(wid)
            await handle.signal(ANNOUNCE, {"name": "junk", "procs": "many", "bogus": 1})
            await handle.signal(ANNOUNCE, {"unexpected": True})
            await handle.signal(ANNOUNCE, {**dataclasses.asdict(a), "name": "typed-junk",
                                           "procs": "many"})
            await handle.signal(ANNOUNCE, {**dataclasses.asdict(a), "name": "bad-port",
                                           "rdzv_port": 70000})
            await handle.signal(ANNOUNCE, ["not", "a", "dict"])

            async def nodes():
                return await handle.query(NodeRegistry.nodes)
            for _ in range(50):
                got = await nodes()
                if [n.name for n in got] == ["a", "b"] and got[0].busy:
                    break
                await asyncio.sleep(0.1)
            assert [n.name for n in got] == ["a", "b"]
            assert got[0].busy == "run-1 0-100" and got[0].procs == 8
            assert all(before - 5 <= n.seen <= time.time() + 5 for n in got)
            await handle.signal(LEAVE, "a")
            for _ in range(50):
                if [n.name for n in await nodes()] == ["b"]:
                    break
                await asyncio.sleep(0.1)
            assert [n.name for n in await nodes()] == ["b"]
            desc = await handle.describe()
            assert desc.status.name == "RUNNING"  # junk did not fail it
            await handle.terminate("test over")
    asyncio.run(go())

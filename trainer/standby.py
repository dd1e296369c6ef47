"""`python -m trainer.standby`: a trainer launcher that is ready before it is needed.

A cold segment start pays torchrun's interpreter and torch import, then each rank's torch,
DeepSpeed and trainer imports and the first optimizer's import of torch._dynamo: 5-8 s of
CPU on this machine before any work, more on a GPU node. A trainer worker keeps one of
these processes standing by (activities/standby.py). It has done those imports and nothing
else (no thread pool run, no process group, no CUDA context) and waits on stdin for one
`LaunchRequest` (common/protocol.py). Then it is that segment's launcher, as torchrun
(`--standalone`, or a static rendezvous on the gang's node 0) would be:

- each rank is a fork() of it running `-m module args` as __main__, with RANK, LOCAL_RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT set (rank 0 hosts
  the process group's store: torch.distributed's env:// rendezvous);
- when a rank fails it prints torchrun's failure summary (`Root Cause`: rank, exit code)
  and says it stops the others as torchrun does (`Sending process N closing signal
  SIGTERM`, what the supervisor acts on at once), SIGKILLs them after STOP_GRACE_S and
  exits 1; all ranks done: 0;
- a SIGTERM it gets goes on to every rank (a preemption notice, as torchrun forwards it);
- it dies with its parent, the worker (the parent-death signal; a worker that died before
  the signal was armed shows as a parent other than `--parent-pid`), and its ranks die
  with it.
Its first line on stdout, "ready", tells the worker the imports are done.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import runpy
import signal
import socket
import sys
import time
import traceback

from common.procs import RANK_NAME, set_parent_death_signal
from common.protocol import LaunchRequest

READY = "ready"
STOP_GRACE_S = 5.0  # a rank still alive this long after a peer failed and it got SIGTERM
PR_SET_NAME = 15  # <linux/prctl.h>: the process name ps and psutil show (ops/chaos.py)


def warm_imports() -> None:
    """What every rank would import first, imported once here (no work is run)."""
    import deepspeed
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim's first optimizer imports it: ~1.4 s)

    import trainer.evaluate  # noqa: F401
    import trainer.segment  # noqa: F401  (the trainer and all it imports)
    deepspeed.utils.logger.setLevel("WARNING")
    if not torch.cuda.is_available():  # (on CUDA the probe would touch the devices: no
        warm_cpu_comm()               # CUDA context may exist before the fork)


def warm_cpu_comm() -> None:
    """What `deepspeed.init_distributed` does first on CPU, done once here: probe which of
    DeepSpeed's ops build on this machine (a C compiler run, setuptools imported) and load
    its shared-memory allreduce op — 0.4 s of each rank's start-up, paid again on every restart. Both are
    cached in the process (`deepspeed.ops.__compatible_ops__`, the op builders' loaded
    ops), so every fork reuses them; the op is initialised per rank, later. Its "built
    successfully" goes to stderr: stdout carries only the READY line."""
    import contextlib

    from deepspeed.comm.torch import build_shm_op
    with contextlib.redirect_stdout(sys.stderr):
        build_shm_op()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(req: LaunchRequest, local: int, port: int) -> dict[str, str]:
    """Pure: the variables torchrun gives rank `local` of this node."""
    rank = req.node_rank * req.procs + local
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(req.node_rank),
            "ROLE_RANK": str(rank), "WORLD_SIZE": str(req.nnodes * req.procs),
            "LOCAL_WORLD_SIZE": str(req.procs), "MASTER_ADDR": req.master_addr,
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0"}


def failure_summary(rank: int, local: int, code: int, pid: int, ts: float) -> str:
    """Pure: torchrun's summary of the first failure (common/fault_kinds.py reads it)."""
    when = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(ts))
    return ("Root Cause (first observed failure):\n[0]:\n"
            f"  time      : {when}\n  host      : {socket.gethostname()}\n"
            f"  rank      : {rank} (local_rank: {local})\n"
            f"  exitcode  : {code} (pid: {pid})\n")


def redirect(log: str) -> None:
    """Output to the segment's log (appended), input from /dev/null."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.dup2(null, 0)
    os.close(out)
    os.close(null)


def run_rank(req: LaunchRequest, local: int, port: int, launcher: int) -> None:
    """In the forked child: become rank `local` of this node; never returns."""
    code = 1
    try:
        set_parent_death_signal()
        if os.getppid() != launcher:  # the launcher died before the signal was armed
            os._exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        env = rank_env(req, local, port)
        os.environ.update(env)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(PR_SET_NAME, RANK_NAME.format(env["RANK"]).encode())
        sys.argv = [req.module, *req.args]
        sys.modules.pop(req.module, None)  # run as `-m` would: __main__ its only copy
        runpy.run_module(req.module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 — the rank's own crash: printed, exit 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(req: LaunchRequest) -> int:
    """Start this node's ranks of `req` and wait for them (torchrun's exit codes)."""
    redirect(req.log)
    os.chdir(req.cwd)
    os.environ.clear()
    os.environ.update(req.env)
    port = req.master_port or free_port()
    ranks: dict[int, tuple[int, int]] = {}
    signal.signal(signal.SIGTERM, lambda *_: [_signal(p, signal.SIGTERM) for p in list(ranks)])
    launcher = os.getpid()  # before the fork: a child's getppid() could already be another
    for local in range(req.procs):
        pid = os.fork()
        if pid == 0:
            run_rank(req, local, port, launcher)
        ranks[pid] = (req.node_rank * req.procs + local, local)
    print(f"standby launched {req.procs} rank(s) of {req.module}: pids {sorted(ranks)}, "
          f"store {req.master_addr}:{port}", flush=True)
    return wait_ranks(ranks)


def root_cause(failed: list[tuple[int, int, int, int, float]]
               ) -> tuple[int, int, int, int, float]:
    """Pure: of the ranks (rank, local, code, pid, ts) that failed together, the one that
    failed first — one killed by a signal before one that exited with an error (a peer's
    death breaks its collectives: it exits on its own a moment later), then the lowest."""
    return min(failed, key=lambda f: (f[2] >= 0, f[0]))


def reap(ranks: dict[int, tuple[int, int]]) -> list[tuple[int, int, int, int, float]]:
    """The ranks that ended since the last call, removed from `ranks`."""
    out = []
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            break
        if pid in ranks:
            rank, local = ranks.pop(pid)
            out.append((rank, local, os.waitstatus_to_exitcode(status), pid, time.time()))
    return out


def wait_ranks(ranks: dict[int, tuple[int, int]]) -> int:
    failed = False
    stopped_at: float | None = None
    while ranks:
        ended = [f for f in reap(ranks) if f[2] != 0]
        if ended and not failed:
            failed = True
            time.sleep(0.1)  # a rank its peer's death broke ends at once: judge them together
            first = root_cause(ended + [f for f in reap(ranks) if f[2] != 0])
            # the summary first: the supervisor reads who failed before the others go too
            print(failure_summary(*first), flush=True)
            for p in ranks:
                print(f"Sending process {p} closing signal SIGTERM", flush=True)
                _signal(p, signal.SIGTERM)
            stopped_at = time.monotonic()
        if stopped_at is not None and time.monotonic() - stopped_at > STOP_GRACE_S:
            for p in list(ranks):
                _signal(p, signal.SIGKILL)
            stopped_at = None
        time.sleep(0.05)
    return 1 if failed else 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def parent_pid(argv: list[str]) -> int:
    """Pure: the `--parent-pid` the worker started this standby with."""
    parser = argparse.ArgumentParser(prog="python -m trainer.standby")
    parser.add_argument("--parent-pid", type=int, required=True,
                        help="the worker's pid: a different parent means it died already")
    return parser.parse_args(argv).parent_pid


def main(argv: list[str]) -> int:
    parent = parent_pid(argv)
    set_parent_death_signal()
    # The worker died before the signal was armed: we were re-parented. Compared with the
    # worker's own pid, not with 1: the worker may be PID 1 of its container, and a
    # re-parented child may go to a subreaper that is not.
    if os.getppid() != parent:
        return 1
    warm_imports()
    print(READY, flush=True)
    line = sys.stdin.readline()
    if not line.strip():  # the worker let it go unused
        return 0
    return launch(LaunchRequest.from_json(line))


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

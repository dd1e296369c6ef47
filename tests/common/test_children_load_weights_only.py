"""No process mainspring starts unpickles bucket data (DESIGN §3): every kind of child is
started the way mainspring starts it — its launcher, its environment — running a probe
(tests/common/pickle_probe.py) that unpickles a payload as DeepSpeed's own tools do,
`torch.load(..., weights_only=False)`. The payload writes a marker file; it never appears.

The kinds: trainer ranks under torchrun and as forks of a warm standby (trainer/standby.py),
plain `python -m` children (trainer.evaluate; trainer.export, which a person starts),
the checkpoint writer (storage.tiered_writer), DeepSpeed's ds_to_universal conversion
(trainer/elastic.py; the converter itself: tests/trainer/test_safe_load.py) and the
workers a WorkerFleet starts. A control runs the same probe with nothing forcing it: there
the payload does run, so the probe is able to tell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from activities.standby import Standby
from activities.supervise import child_env, trainer_command
from common.procs import FORCED_CHILD_ENV, worker_env
from common.protocol import LaunchRequest
from storage.checkpoints import CheckpointStore
from storage.tiered import TierPolicy, start_writer
from tests.common.proc_environ import environ_of
from tests.trainer.helpers import REPO
from trainer.elastic import conversion_command, conversion_env

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

PROBE = "tests.common.pickle_probe"


class RunsShell:
    """Pickles as a call of os.system: what a bucket writer would plant."""

    def __init__(self, marker: Path) -> None:
        self.command = f"touch {marker}"

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.fixture
def payload(tmp_path) -> tuple[Path, Path]:
    """(a checkpoint-like file whose pickle runs a shell command, the marker it would write)"""
    marker = tmp_path / "pwned"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": RunsShell(marker), "pad": torch.zeros(4)}, path)
    return path, marker


def bare_env(**extra: str) -> dict[str, str]:
    """What a person's shell might hand a process: nothing of mainspring's."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO),
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **extra}


def probed(cmd: list[str], env: dict[str, str], out: Path) -> dict:
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert out.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


def assert_refused(result: dict, marker: Path) -> None:
    assert not marker.exists(), "the payload ran"
    assert result["refused"] and "system" in result["refused"], result


def test_the_probe_runs_a_payload_where_nothing_forces_weights_only(payload, tmp_path):
    path, marker = payload
    result = probed([sys.executable, "-m", PROBE, str(path), str(tmp_path / "out.json")],
                    bare_env(), tmp_path / "out.json")
    assert result["refused"] is None and marker.exists()  # the control: the probe can tell


def test_a_trainer_rank_under_torchrun_refuses_to_unpickle(payload, tmp_path):
    path, marker = payload
    out = tmp_path / "out.json"
    result = probed(trainer_command(PROBE, 1, [str(path), str(out)]), child_env(), out)
    assert result["forced"] == "1"
    assert_refused(result, marker)


def test_a_trainer_rank_forked_by_a_warm_standby_refuses_to_unpickle(payload, tmp_path):
    path, marker = payload
    out = tmp_path / "out.json"
    env = child_env()
    standby = Standby(env)
    try:
        assert standby.wait_ready(), Path(standby.log).read_text()[-2000:]
        proc = standby.launch(LaunchRequest(module=PROBE, args=[str(path), str(out)], procs=1,
                                            cwd=str(tmp_path), log=str(tmp_path / "log"),
                                            env=env))
        assert proc.wait(timeout=120) == 0, (tmp_path / "log").read_text()[-2000:]
    finally:
        if standby.proc.poll() is None:
            standby.proc.kill()
            standby.proc.wait()
    assert_refused(json.loads(out.read_text()), marker)


def test_a_python_m_child_such_as_evaluate_refuses_to_unpickle(payload, tmp_path):
    path, marker = payload
    out = tmp_path / "out.json"
    result = probed([sys.executable, "-m", PROBE, str(path), str(out)], child_env(), out)
    assert_refused(result, marker)


@pytest.mark.parametrize("entry", ["trainer.evaluate", "trainer.export"])
def test_evaluate_and_export_refuse_to_unpickle_even_when_started_by_hand(entry, payload,
                                                                          tmp_path):
    """A person may run them from a shell with none of the child environment: the entry
    point forces weights-only loading itself (trainer/safe_load.py force_weights_only)."""
    path, marker = payload
    out = tmp_path / "out.json"
    env = bare_env(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")  # even with its opposite set
    result = probed([sys.executable, "-m", PROBE, str(path), str(out), entry], env, out)
    assert result["entry_rc"] == 3  # the entry point ran (and stopped on the missing spec)
    assert_refused(result, marker)


def test_the_checkpoint_writer_runs_with_weights_only_loading_forced(payload, tmp_path):
    """The writer only uploads bytes; the environment it is started with forces weights-only
    loads all the same. Its real environment (/proc) runs the probe."""
    path, marker = payload
    durable = CheckpointStore(str(tmp_path / "durable"), "r")
    fast = CheckpointStore(str(tmp_path / "fast"), "r")
    proc = start_writer(durable, fast, TierPolicy())
    try:
        env = environ_of(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert {k: env.get(k) for k in FORCED_CHILD_ENV} == FORCED_CHILD_ENV
    out = tmp_path / "out.json"
    assert_refused(probed([sys.executable, "-m", PROBE, str(path), str(out)], env, out), marker)


def test_the_resharding_conversion_runs_weights_only_behind_its_wrapper(payload, tmp_path):
    path, marker = payload
    cmd = conversion_command(str(tmp_path / "in"), str(tmp_path / "u"))
    assert cmd[1:3] == ["-m", "trainer.universal"]  # not DeepSpeed's module directly
    out = tmp_path / "out.json"
    result = probed([sys.executable, "-m", PROBE, str(path), str(out)], conversion_env(), out)
    assert_refused(result, marker)


def test_a_worker_started_by_a_worker_fleet_refuses_to_unpickle(payload, tmp_path):
    path, marker = payload
    out = tmp_path / "out.json"
    env = worker_env({**bare_env(), "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    assert_refused(probed([sys.executable, "-m", PROBE, str(path), str(out)], env, out), marker)

"""One classification path for every trainer child: a MainspringError in
the child becomes error.json naming its kind and retryability, and the supervisor turns it
into a Temporal failure that is retried only when the error says it may be. Real child
processes under the real supervisor."""

from __future__ import annotations

import json
import sys

import pytest
from temporalio.exceptions import ApplicationError

from activities.supervise import child_env, supervise

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

CHILD = """
import sys
from common import errors
from trainer.child import run_classified
from trainer.safe_load import UnsafeCheckpointFile
kind, workdir = sys.argv[1], sys.argv[2]
make = {"Diverged": lambda: errors.Diverged(7, "no committed checkpoint before the onset"),
        "UnsafeCheckpointFile": lambda: UnsafeCheckpointFile("x.pt", "os.system"),
        "HardwareFault": lambda: errors.HardwareFault("rank 1 lost")}[kind]
def body():
    raise make()
sys.exit(run_classified("segment", workdir, body))
"""


@pytest.mark.parametrize("kind, retried", [("Diverged", False), ("UnsafeCheckpointFile", False),
                                           ("HardwareFault", True)])
def test_a_child_error_is_retried_only_when_it_may_succeed_next_time(tmp_path, kind, retried):
    # On e3369a3 trainer.segment's own handler exited 1 without error.json for Diverged,
    # and the supervisor retried it as a HardwareFault for the whole segment budget.
    with pytest.raises(ApplicationError) as err:
        supervise([sys.executable, "-c", CHILD, kind, str(tmp_path)], workdir=str(tmp_path),
                  env=child_env(), poll_s=0.1)
    assert err.value.type == kind and err.value.non_retryable is (not retried)
    written = json.loads((tmp_path / "error.json").read_text())
    assert written["type"] == kind and written["retryable"] is retried



ANY_EXCEPTION = """
import sys
from trainer.child import run_classified
workdir, message = sys.argv[1], sys.argv[2]
def allocate():
    raise RuntimeError(message)
sys.exit(run_classified("segment", workdir, allocate))
"""


@pytest.mark.parametrize("message, kind", [
    ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
     "memory: you tried to allocate 314572800 bytes. Error code 12 (Cannot allocate memory)",
     "oom"),
    ("shape mismatch in the trainer's own code", "crash")])
def test_any_exception_leaves_its_type_and_frame_and_is_classified_from_its_message(
        tmp_path, message, kind):
    # An exception outside the MainspringError classes once left no error.json:
    # a CPU allocation failure was a `crash` retried as it was, and two crashes could not
    # be told apart for the repeated-failure budget.
    seen = []
    with pytest.raises(ApplicationError) as err:
        supervise([sys.executable, "-c", ANY_EXCEPTION, str(tmp_path), message],
                  workdir=str(tmp_path), env=child_env(), poll_s=0.1, on_failure=seen.append)
    assert err.value.type == "RuntimeError" and not err.value.non_retryable
    written = json.loads((tmp_path / "error.json").read_text())
    assert written["frame"].endswith("in allocate") and written["frame"].startswith("<string>:")
    [failure] = seen
    assert failure.kind == kind and failure.frame == written["frame"]
    assert failure.error_type == "RuntimeError"


def test_the_first_rank_to_write_error_json_wins(tmp_path):
    from common.protocol import ErrorReport
    from trainer.child import write_json

    path = str(tmp_path / "error.json")
    write_json(path, ErrorReport(type="OutOfMemoryError", message="root"), first_wins=True)
    write_json(path, ErrorReport(type="RuntimeError", message="peer reset"), first_wins=True)
    assert json.loads((tmp_path / "error.json").read_text())["message"] == "root"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

"""One classification path for every trainer child (issue 12 item 4): a MainspringError in
the child becomes error.json naming its kind and retryability, and the supervisor turns it
into a Temporal failure that is retried only when the error says it may be. Real child
processes under the real supervisor."""

from __future__ import annotations

import json
import sys

import pytest
from temporalio.exceptions import ApplicationError

from activities.supervise import child_env, supervise

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


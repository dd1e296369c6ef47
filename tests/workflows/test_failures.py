"""Which exceptions in workflow code fail the run (workflows/failures.py).

The e2e side (tests/e2e/test_bad_specs.py) shows an OverflowError in TrainingRun failing
the run for real; this pins the choice for both workflows, including what must NOT fail a
run: nondeterminism and sandbox violations, which a fixed deploy resolves.
"""

import pytest
from temporalio import workflow
from temporalio.worker.workflow_sandbox import RestrictedWorkflowAccessError

from common.errors import BadConfig
from workflows.sweep import Sweep
from workflows.training_run import TrainingRun


def _fails_the_run(cls, exc: BaseException) -> bool:
    types = workflow._Definition.must_from_class(cls).failure_exception_types
    return any(isinstance(exc, t) for t in types)


@pytest.mark.parametrize("cls", [TrainingRun, Sweep])
def test_bugs_and_bad_input_in_workflow_code_fail_the_run_instead_of_retrying_its_task(cls):
    for exc in (OverflowError("timedelta"), KeyError("raw"), TypeError("x"), ValueError("y"),
                ZeroDivisionError(), AttributeError("z"), IndexError(), AssertionError(),
                BadConfig("train.warmup_steps", "must be in [0, total_steps)")):
        assert _fails_the_run(cls, exc), exc


@pytest.mark.parametrize("cls", [TrainingRun, Sweep])
def test_nondeterminism_and_sandbox_violations_still_suspend_the_run_for_a_fixed_deploy(cls):
    assert _fails_the_run(cls, OverflowError())  # the list is set at all
    for exc in (workflow.NondeterminismError("replay"), RestrictedWorkflowAccessError("os.stat"),
                RuntimeError("Failed finding activity handle")):
        assert not _fails_the_run(cls, exc), exc

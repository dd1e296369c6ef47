"""Which exceptions raised in workflow code fail the workflow instead of its task.

By default the Temporal SDK fails only the workflow *task* for an exception that is not a
Temporal failure, and retries that task forever: a deterministic bug (an OverflowError, a
KeyError, a BadConfig in workflow code) left the run "Running" with no end. These types
fail the run at once with the exception's type and message (docs/decisions.md,
"Workflow code: bugs fail the run").

Not listed, on purpose: `temporalio.workflow.NondeterminismError` (and the sandbox's
`RestrictedWorkflowAccessError`, a subclass) and the SDK's own `RuntimeError`s. Those come
from a bad deploy, not from a run's input; a suspended workflow task waits for a fixed
worker and then continues, where a failed run would have to be started again by hand.
That is why this is not `[Exception]`, which would include them.
"""

from __future__ import annotations

from common.errors import MainspringError

FAILURE_EXCEPTION_TYPES: list[type[BaseException]] = [
    MainspringError,  # BadConfig / BadData raised by spec checks inside workflow code
    ArithmeticError,  # OverflowError (timedelta of a huge number), ZeroDivisionError
    AssertionError,
    AttributeError,
    LookupError,  # KeyError, IndexError
    NameError,
    TypeError,
    ValueError,  # also a workflow input that does not decode
]

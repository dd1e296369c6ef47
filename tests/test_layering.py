"""A worker process never imports torch (DESIGN §5: it restarts in about a second after a
SIGKILL, and a trainer's crash cannot take its heartbeats with it). On e3369a3 every worker
imported torch through activities/training.py -> trainer/faults.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
import activities.data, activities.events, activities.runs, activities.suggest
import activities.training, ops.worker
import workflows.training_run, workflows.sweep
heavy = sorted(m for m in ("torch", "deepspeed", "numpy.linalg") if m in sys.modules)
print(",".join(heavy))
"""


def test_every_module_a_worker_loads_leaves_torch_and_deepspeed_unimported():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert "torch" not in out.stdout and "deepspeed" not in out.stdout, out.stdout

"""The demo as a user runs it (`mainspring demo --json`, what `make demo` runs): its wall time,
the share of it the warm-up sweep took, and the held-out loss it ends at.

The sweep's share is the `warmup_sweep` stage's span in the run's own event log (its
`stage_started` to its `stage_finished`) over the demo command's wall time (server, workers,
every stage, the report); the loss is the summary's `final_val_loss` (the evaluate stage's,
on the promoted step). Targets: the sweep at most 25 % of the wall time, the loss at most
5.5, the wall time no longer than the ~130 s the demo took before the sweep earned its cost.

Prints ONE JSON line: {"figure": "demo", "wall_s", "sweep_s", "sweep_fraction",
"final_val_loss", "initial_val_loss", the stages' seconds, the trials, the inputs}.

    .venv/bin/python benchmarks/demo.py [--state-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spec import preset  # noqa: E402
from storage.events import read_events  # noqa: E402


def stage_seconds(events: list[dict]) -> dict[str, float]:
    """Pure: each stage's seconds, from its `stage_started` to its `stage_finished` event."""
    started, out = {}, {}
    for e in events:
        stage = e["payload"].get("stage")
        if e["kind"] == "stage_started":
            started[stage] = e["ts"]
        elif e["kind"] == "stage_finished" and stage in started:
            out[stage] = round(e["ts"] - started[stage], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-dir", default="", help="the demo's state (default: a temp dir)")
    args = ap.parse_args()
    state = args.state_dir or tempfile.mkdtemp(prefix="mainspring-demo-bench-")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "demo", "--json",
                           "--state-dir", os.path.join(state, "state")],
                          capture_output=True, text=True, cwd=state,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"demo failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    events = read_events(os.path.join(state, "state", "store"), summary["run_id"])
    stages = stage_seconds(events)
    trials = [{"params": e["payload"]["params"], "result": round(e["payload"]["result"], 4),
               "source": e["payload"].get("source")}
              for e in events if e["kind"] == "sweep_trial"]
    demo = preset("demo")
    print(json.dumps({
        "figure": "demo", "wall_s": round(wall, 1), "sweep_s": stages.get("warmup_sweep"),
        "sweep_fraction": round(stages.get("warmup_sweep", 0.0) / wall, 3),
        "final_val_loss": round(summary["final_val_loss"], 4),
        "initial_val_loss": round(summary["initial_val_loss"], 4),
        "stages_s": stages, "trials": trials, "status": summary["status"],
        "inputs": {"total_steps": demo.train.total_steps, "trials": demo.sweep.trials,
                   "trial_steps": demo.sweep.trial_steps, "parallel": demo.sweep.parallel,
                   "spec_hash": demo.spec_hash(), "cpus": os.cpu_count(),
                   "load_average": round(os.getloadavg()[0], 2)}}))


if __name__ == "__main__":
    main()

"""Distillation: a student's held-out loss with the promoted teacher vs without, at equal steps.

On the default corpus (the standard library's sources, the demo's data section): the teacher
(the demo's model) trains TEACHER_STEPS steps and its last step is promoted; then the same
student model, from the same initial weights on the same batches, trains STUDENT_STEPS
steps twice — with the teacher (distill.teacher, alpha, temperature) and without — each as
the real `trainer.segment` under torchrun (CPU, gloo), exactly as a student run's segments
run. `trainer.evaluate` then measures all three on the same held-out batches.

The teacher's cost per step: its forward time (the `teacher_cost` event the student's
segment records) and the student's step time with it minus without; its memory: the
teacher's weights plus the logits its forward holds (micro-batch x seq_len x vocab floats).
Exact resume: the student trained to STUDENT_STEPS/2, then on in a new process from that
commit (as after a kill), against the straight student: the largest weight difference.

Prints ONE JSON line: {"figure": "distill", "student_val_loss", "baseline_val_loss",
"teacher_val_loss", "gain" (baseline - student), the cost, the resume difference, the
inputs}. Progress on stderr.

    .venv/bin/python benchmarks/distill.py [--teacher-steps 300] [--student-steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from common.telemetry import configure_logging

configure_logging()  # logs on stderr: stdout carries the one JSON line of the figure
from dataprep.pipeline import prepare_dataset
from spec import RunSpec, preset
from spec.distill import default_student
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from storage.runs import claim_run
from tests.trainer.helpers import REPO, run_segment, write_spec
from trainer.evaluate import MODEL_FILE
from trainer.safe_load import safe_torch_load
from trainer.state import flat_tensors

ALPHA, TEMPERATURE = 0.5, 2.0
EVAL_BATCHES = 32


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def spec_of(store: Path, run_id: str, steps: int, **over) -> RunSpec:
    """The demo preset (its data and model) as a plain run of `steps` steps in `store`."""
    return preset("demo", **{"run_id": run_id, "storage.durable": str(store),
                             "storage.fast": str(store.parent / "fast"), "faults": [],
                             "sweep.enabled": False, "train.total_steps": steps,
                             "train.segment_steps": steps, "train.checkpoint_every": steps,
                             "train.eval_every": 0, "train.eval_batches": EVAL_BATCHES, **over})


def train(spec: RunSpec, dataset: str, root: Path) -> Path:
    """One segment 0 -> total_steps, as the supervisor launches it; its workdir."""
    work = root / f"w-{spec.run_id}"
    t0 = time.time()
    proc = run_segment(write_spec(spec, root / f"{spec.run_id}.json"), dataset,
                       spec.train.total_steps, work, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-6000:])
    say("trained", spec.run_id, f"{time.time() - t0:.0f}s")
    return work


def held_out(spec: RunSpec, dataset: str, root: Path) -> float:
    """The held-out loss of the run's last step, as the evaluate stage measures it."""
    out = root / f"eval-{spec.run_id}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.evaluate", "--spec",
         write_spec(spec, root / f"eval-{spec.run_id}-spec.json"), "--dataset", dataset,
         "--steps", str(spec.train.total_steps), "--workdir", str(root / f"we-{spec.run_id}"),
         "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-4000:])
    return json.loads(out.read_text())["results"][0]["val_loss"]


def resumed_diff(store: Path, straight: RunSpec, resumed: RunSpec, dataset: str, root: Path
                 ) -> float:
    """`resumed` trained 0 -> N/2, then N/2 -> N in a new process (as after a kill): the
    largest weight difference at step N from `straight`, trained 0 -> N in one."""
    spec = write_spec(resumed, root / f"{resumed.run_id}.json")
    n = resumed.train.total_steps
    for to_step, attempt in ((n // 2, 1), (n, 2)):
        proc = run_segment(spec, dataset, to_step, root / f"w-{resumed.run_id}-{to_step}",
                           attempt=attempt, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(proc.stdout[-3000:] + proc.stderr[-6000:])

    def weights(run: str) -> dict:
        path = store / "runs" / run / "checkpoints" / f"step-{n:09d}" / MODEL_FILE
        return {k: v for k, v in flat_tensors(safe_torch_load(str(path), map_location="cpu"))
                .items() if k.startswith("/module/")}
    a, b = weights(straight.run_id), weights(resumed.run_id)
    assert a.keys() == b.keys() and a
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def step_times(work: Path) -> list[float]:
    lines = [json.loads(ln) for ln in (work / "progress.jsonl").read_text().splitlines()]
    return [ln["step_time_s"] for ln in lines if ln["type"] == "step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--teacher-steps", type=int, default=300)
    p.add_argument("--student-steps", type=int, default=300)
    args = p.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = root / "store"
        teacher = spec_of(store, "teacher", args.teacher_steps)
        dataset, manifest, _ = prepare_dataset(teacher.data, str(store), teacher.seed)
        say("dataset", manifest.tokens("train"), "train tokens")
        claim_run(str(store), teacher.run_id, teacher.spec_hash(), teacher.to_dict())
        train(teacher, dataset, root)
        CheckpointStore(str(store), teacher.run_id).promote(args.teacher_steps)
        student_model = dict(default_student().__dict__)
        # a commit half-way too, where the resumed student stops
        model = {**{f"model.{k}": v for k, v in student_model.items()},
                 "train.checkpoint_every": args.student_steps // 2}
        taught = {"distill.teacher": f"teacher@{args.teacher_steps}", "distill.alpha": ALPHA,
                  "distill.temperature": TEMPERATURE}
        student = spec_of(store, "student", args.student_steps, **model, **taught)
        baseline = spec_of(store, "baseline", args.student_steps, **model)
        w_student, w_base = train(student, dataset, root), train(baseline, dataset, root)
        resume_diff = resumed_diff(store, student, spec_of(
            store, "student-resumed", args.student_steps, **model, **taught), dataset, root)
        losses = {s.run_id: held_out(s, dataset, root) for s in (teacher, student, baseline)}
        [cost] = read_events(str(store), "student", kinds=("teacher_cost",))
        cost = cost["payload"]
        with_t, without = step_times(w_student)[5:], step_times(w_base)[5:]  # past warm-up
    micro = teacher.train.micro_batch_tokens  # tokens per micro-batch: B x seq_len
    logits_bytes = cost["logits_bytes"]  # the teacher's fp32 logits of one micro-batch
    print(json.dumps({
        "figure": "distill",
        "student_val_loss": round(losses["student"], 4),
        "baseline_val_loss": round(losses["baseline"], 4),
        "teacher_val_loss": round(losses["teacher"], 4),
        "gain": round(losses["baseline"] - losses["student"], 4),
        "teacher_forward_s_per_step": cost["forward_s_per_step"],
        "extra_step_s": round(statistics.median(with_t) - statistics.median(without), 5),
        "step_s_with_teacher": round(statistics.median(with_t), 5),
        "step_s_without": round(statistics.median(without), 5),
        "teacher_weight_bytes": cost["weight_bytes"],
        "teacher_logits_bytes_per_micro_batch": logits_bytes,
        "extra_bytes": cost["weight_bytes"] + logits_bytes,
        "student_resume_max_abs_weight_diff": resume_diff,
        "inputs": {"corpus": teacher.data.corpus, "max_documents": teacher.data.max_documents,
                   "vocab_size": manifest.vocab_size, "teacher_model": teacher.model.__dict__,
                   "student_model": student_model, "teacher_params": cost["params"],
                   "teacher_steps": args.teacher_steps, "student_steps": args.student_steps,
                   "alpha": ALPHA, "temperature": TEMPERATURE, "micro_batch_tokens": micro,
                   "eval_batches": EVAL_BATCHES, "device": "cpu", "world_size": 1},
        "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()

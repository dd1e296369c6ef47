"""RunSpec: the one root config of a run (DESIGN §9), its cross-field rules, its hash and the
presets. Stdlib only — the workflow imports it.

Each section lives in the module named for what it configures (spec/data.py, model.py,
train.py, sweep.py, storage.py, spikes.py, faults.py, ops.py) and checks its own fields;
the rules here span sections: the batch against the sequence length, the checkpoint
cadence against the segment, the storage and input URLs (common/urls.py) and every trial
the sweep can run, so nothing the workflow derives from a valid spec can fail.
`RunSpec.from_dict` is the only way JSON/TOML becomes a spec (spec/codec.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from common import urls
from common.errors import BadConfig
from spec.codec import build, deep_merge, dotted_to_nested, num
from spec.codec import require as _require
from spec.data import DataConfig
from spec.distill import MAX_TEACHER_RUN_ID, DistillConfig, default_dict, student_spec
from spec.faults import MAX_FAULTS, FaultSpec
from spec.layout import LayoutConfig, check_layout, planned_layout
from spec.model import ModelConfig
from spec.ops import OpsConfig
from spec.spikes import SpikeConfig, check_batch_bound
from spec.storage import StorageConfig
from spec.sweep import (
    SweepConfig,
    accumulation_tokens,
    point_overrides,
    sized_trial_steps,
    sweep_budget,
    sweep_ends,
    trial_overrides,
)
from spec.train import TrainConfig

__all__ = ["RunSpec", "PRESETS", "preset"]

RUN_ID_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # fullmatch: "demo\n" is not a run id


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    # Sections added after runs were claimed, with the default they came with: out of
    # spec_hash at that default (without_added), so those runs keep their hash.
    ADDED: ClassVar[dict[str, Any]] = {"distill": default_dict()}

    run_id: str
    seed: int = num(1234, 0, 2**63 - 1)  # fits a signed 64-bit integer everywhere it goes
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    spikes: SpikeConfig = field(default_factory=SpikeConfig)
    faults: tuple[FaultSpec, ...] = ()
    ops: OpsConfig = field(default_factory=OpsConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)  # spec/distill.py

    def __post_init__(self) -> None:
        _require(bool(RUN_ID_RE.fullmatch(self.run_id)), "run_id",
                 f"{self.run_id[:80]!r} is not a valid run id",
                 "use lowercase letters, digits and '-', starting with a letter or digit, "
                 "at most 63 characters")
        if self.sweep.trial_steps == "auto":  # the run's spec holds the number it comes to
            object.__setattr__(self, "sweep", resized("sweep", self.sweep, trial_steps=(
                sized_trial_steps(self.sweep, self.train))))
        if self.train.layout == "auto":  # the run's spec holds the layout it comes to
            lay = planned_layout(self.train, self.model, self.data.tokenizer.vocab_size,
                                 self.sweep.enabled)
            object.__setattr__(self, "train", resized("train", self.train, layout=lay,
                                                      zero_stage=lay.zero))
        t, m = self.train, self.model
        _require(t.micro_batch_tokens % m.seq_len == 0, "train.micro_batch_tokens",
                 f"{t.micro_batch_tokens} is not a multiple of model.seq_len={m.seq_len}",
                 "make micro_batch_tokens a multiple of seq_len")
        check_batch_bound(t.grad_accum, self.spikes)  # an oscillation's raise stays valid
        if t.auto_checkpoint:  # the chosen interval lies in [checkpoint_every_min, segment_steps]
            _require(t.checkpoint_every_min <= t.segment_steps, "train.checkpoint_every_min",
                     f"is longer than a segment ({t.segment_steps} steps)",
                     "make checkpoint_every_min <= segment_steps")
        else:
            _require(t.checkpoint_every <= t.segment_steps, "train.checkpoint_every",
                     "is longer than a segment", "make checkpoint_every <= segment_steps")
        _require(len(self.faults) <= MAX_FAULTS, "faults",
                 f"has {len(self.faults)} entries (at most {MAX_FAULTS})", "inject fewer faults")
        for i, f in enumerate(self.faults):  # a rank the run does not have would never fire
            _require(f.kind != "corrupt_grad" or f.rank < t.world_size, f"faults[{i}].rank",
                     f"is {f.rank}, but the run has {t.world_size} rank(s)",
                     f"name a rank below train.nodes x train.procs_per_node = {t.world_size}")
        _require(not t.init_from or t.init_from.split("@")[0] != self.run_id,
                 "train.init_from", f"names this run itself ({self.run_id})",
                 "name the run whose promoted checkpoint this one starts from")
        self._check_layout()
        urls.check_durable(self.storage.durable, "storage.durable")
        urls.check_local_dir(self.storage.fast, "storage.fast")
        urls.check_tiers_apart(self.storage.durable, self.storage.fast)
        urls.check_input(self.data.corpus, "data.corpus", stdlib=True)
        if self.data.tokenizer.path:
            urls.check_input(self.data.tokenizer.path, "data.tokenizer.path")
        for i, uri in enumerate(self.data.quarantine):
            urls.check_input(uri, f"data.quarantine[{i}]")
        urls.check_endpoint(self.ops.otlp_endpoint, "ops.otlp_endpoint")
        self._check_distill()
        self._check_sweep()

    def _check_distill(self) -> None:
        """A student run names another run as its teacher; a distill stage's student runs
        (spec/distill.py student_spec) are valid specs, so the stage cannot fail on them."""
        d = self.distill
        _require(not d.teacher or d.teacher.split("@")[0] != self.run_id, "distill.teacher",
                 f"names this run itself ({self.run_id})",
                 "name the finished run whose promoted checkpoint this one learns from")
        if not d.enabled:
            return
        _require(len(self.run_id) <= MAX_TEACHER_RUN_ID, "distill.enabled",
                 f"the student runs' ids ({self.run_id}-student-base) would be longer than "
                 "63 characters", f"use a run id of at most {MAX_TEACHER_RUN_ID} characters")
        _require(d.student.seq_len == self.model.seq_len, "distill.student.seq_len",
                 f"is {d.student.seq_len}, the teacher's model.seq_len is {self.model.seq_len}",
                 f"set distill.student.seq_len to {self.model.seq_len}: both read the same rows")
        for baseline in (False, True) if d.baseline else (False,):
            try:
                RunSpec.from_dict(student_spec(self.to_dict(), 0, baseline=baseline))
            except BadConfig as exc:
                name = student_field(exc.field)
                fix = f"raise distill.steps, or {exc.fix}" if name == "distill.steps" else exc.fix
                raise BadConfig(name, f"the student's run is refused ({exc.field}: "
                                f"{exc.problem})", fix) from None

    def _check_sweep(self) -> None:
        """The sweep against the run: lr above min_lr, the batch in whole accumulation
        steps, the budget (spec/sweep.py sweep_budget), then every trial it can run."""
        t, sw = self.train, self.sweep
        if not sw.enabled:
            return
        lr_dim = sw.space.get("lr")
        _require(not (lr_dim and lr_dim.low < t.min_lr),
                 "sweep.space.lr.low", f"is below train.min_lr={t.min_lr}",
                 "raise the sweep's lower bound or lower train.min_lr")
        batch, unit = sw.space.get("batch_tokens"), accumulation_tokens(t)
        for end, value in (("low", batch.low), ("high", batch.high)) if batch else ():
            _require(value % unit == 0, f"sweep.space.batch_tokens.{end}",
                     f"{value:g} tokens is not a whole number of accumulation steps of "
                     f"{unit:,} tokens (train.micro_batch_tokens x {t.world_size} ranks)",
                     f"use a multiple of {unit:,}")
        budget = sweep_budget(sw, t)
        _require(not budget.over, "sweep.budget_fraction", budget.problem(), budget.fix())
        self._check_sweep_ends()

    def _check_layout(self) -> None:
        """`train.layout` against the model and the world, before any process starts."""
        t, m = self.train, self.model
        if not isinstance(t.layout, LayoutConfig):  # "dp" ("auto" became a LayoutConfig)
            return
        check_layout(t.layout, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, n_layers=m.n_layers,
                     nodes=t.nodes, procs_per_node=t.procs_per_node,
                     node_counts=t.node_counts(), zero_stage=t.zero_stage,
                     grad_accum=t.grad_accum, sweep=self.sweep.enabled,
                     precision=t.precision)

    def _check_sweep_ends(self) -> None:
        """Every trial the sweep can run, and the run its best point trains, is a valid spec.

        Checked at both ends of each swept dimension: each rule on a swept value involves
        one swept parameter (lr vs min_lr, warmup_steps vs total_steps, the batch's
        grad_accum vs its range and the layout), so the ends bound every point in between.
        Built by the same overrides as workflows/sweep_plan.py `trial_spec` and
        `with_params`; the checked specs have the sweep off, so they do not check further.
        """
        base = deep_merge(self.to_dict(), {"sweep": {"enabled": False}})
        for name, dim in sorted(self.sweep.space.items()):
            for end, value in sweep_ends(name, dim):
                trial = trial_overrides({name: value}, self.train, self.sweep)
                main = point_overrides({name: value}, self.train)
                for what, over in (("a sweep trial", trial), ("training", main)):
                    try:
                        RunSpec.from_dict(deep_merge(base, dotted_to_nested(over)))
                    except BadConfig as exc:
                        raise BadConfig(
                            f"sweep.space.{name}.{end}",
                            f"{what} with {name}={value!r} is refused ({exc.field}: "
                            f"{exc.problem})",
                            f"narrow sweep.space.{name}" + (f"; {exc.fix}" if exc.fix else "")
                        ) from None

    # ---- (de)serialisation -------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Any) -> RunSpec:
        return build(cls, raw, "")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def spec_hash(self) -> str:
        """The hash of the spec as JSON, retired fields at their last default included and
        added fields left out while at their default, so neither removing nor adding a field
        changes a run's hash (its claim, its checkpoints' config_hash)."""
        d = self.to_dict()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            retired = getattr(type(value), "RETIRED", None)
            if retired:
                d[f.name] = {**retired, **d[f.name]}
            if f.name == "faults":
                d[f.name] = [without_added(FaultSpec, e) for e in d[f.name]]
            elif dataclasses.is_dataclass(value):
                d[f.name] = without_added(type(value), d[f.name])
        if isinstance(self.train.layout, LayoutConfig):  # the planner's reasons are the
            d["train"]["layout"].pop("why")  # record's: the same degrees hash alike
        d = without_added(RunSpec, d)  # a section added later, at its default
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **sections: Any) -> RunSpec:
        """Override fields by dotted name: spec.replace(**{"train.lr": 1e-3})."""
        return RunSpec.from_dict(deep_merge(self.to_dict(), dotted_to_nested(sections)))


def resized(name: str, section: Any, **changes: Any) -> Any:
    """`section` with what a word ("auto") came to: its own checks run again here, outside
    the reader that prefixes their fields, so a refusal is named `<name>.<field>` here."""
    try:
        return dataclasses.replace(section, **changes)
    except BadConfig as exc:
        raise BadConfig(f"{name}.{exc.field}", exc.problem, exc.fix) from None


def student_field(name: str) -> str:
    """The field of this spec that a student run's refused field comes from."""
    if name.startswith("model."):
        return "distill.student." + name.removeprefix("model.")
    if name in ("train.total_steps", "train.warmup_steps"):
        return "distill.steps"  # the student trains distill.steps steps
    return "distill.student" if name == "train.layout" else "distill"


def without_added(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """`d` without the fields `cls.ADDED` lists while they hold the default they were added
    with (spec_hash)."""
    added = getattr(cls, "ADDED", {})
    return {k: v for k, v in ((k, added_within(cls, k, v)) for k, v in d.items())
            if k not in added or v != added[k]}


def added_within(cls: type, name: str, v: Any) -> Any:
    """A section that was itself added (`name` in cls.ADDED, e.g. spikes.oscillation)
    without the fields added to it later, at their default: its record in cls.ADDED was
    taken before they existed, and a run that set the section keeps its hash."""
    f = getattr(cls, "__dataclass_fields__", {}).get(name)
    nested = getattr(f, "default_factory", None)
    if name not in getattr(cls, "ADDED", {}) or not isinstance(v, dict) \
            or not dataclasses.is_dataclass(nested):
        return v
    return without_added(nested, v)


PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for 2 CPU cores in a few minutes; loss falls visibly.
    "demo": {
        "run_id": "demo",
        "data": {"corpus": "stdlib:*.py", "max_documents": 120,
                 "tokenizer": {"vocab_size": 1024}},
        "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "seq_len": 128},
        "train": {"total_steps": 240, "segment_steps": 120, "segments_per_run": 1,
                  "micro_batch_tokens": 1024, "warmup_steps": 10, "checkpoint_every": 20,
                  "eval_every": 40},
        # Both trials at once (the demo's trainer worker takes two): the sweep's cost is
        # mostly each trial's start-up, which two cores overlap.
        "sweep": {"trials": 2, "trial_steps": 15, "parallel": 2},
        # A lost node mid-segment, then a window of bad data (a loss spike -> rollback).
        "faults": [{"kind": "kill_worker", "at_step": 50},
                   {"kind": "corrupt_batches", "at_step": 110, "steps": 4}],
        "ops": {"heartbeat_timeout_s": 10.0},
    },
}


def preset(name: str, **overrides: Any) -> RunSpec:
    if name not in PRESETS:
        raise BadConfig("preset", f"unknown preset {name!r}", f"use one of {', '.join(PRESETS)}")
    return RunSpec.from_dict(deep_merge(PRESETS[name], dotted_to_nested(overrides)))

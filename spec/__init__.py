"""The run spec: `RunSpec`, the one root config of a run, and its sections (DESIGN §9).

One module per section, named for what it configures: `data` (dataprep/), `model`,
`train` (trainer/), `layout` (train.layout and its planner), `sweep` (workflows/sweep.py, sweep/), `storage` (storage/), `spikes`
(trainer/spikes.py, trainer/guard.py), `faults` (trainer/faults.py), `ops` (supervision,
timeouts, telemetry); `run` holds the root, its cross-field rules and the presets;
`codec` turns JSON into sections. Stdlib only — the workflow sandbox imports it.

Every section is a frozen, kw-only dataclass that checks its own fields in `__post_init__`
and raises `BadConfig` naming the field and the fix; each number declares its range with
`num(default, lo, hi)`. `RunSpec.from_dict` (spec/codec.py) is the only way JSON or TOML
becomes a spec: it rejects unknown fields, wrong types, non-finite numbers and values out of
range, naming the dotted field.
"""

from spec.codec import deep_merge, dotted_to_nested
from spec.data import CleaningConfig, DataConfig, DedupConfig, TokenizerConfig
from spec.faults import FaultSpec
from spec.layout import LayoutConfig, plan_layout
from spec.model import ModelConfig
from spec.ops import OpsConfig
from spec.run import PRESETS, RunSpec, preset
from spec.spikes import SpikeBudget, SpikeConfig
from spec.storage import StorageConfig
from spec.sweep import SearchDim, SweepConfig
from spec.train import TrainConfig

__all__ = ["CleaningConfig", "DataConfig", "DedupConfig", "FaultSpec", "LayoutConfig",
           "ModelConfig", "OpsConfig", "RunSpec", "SearchDim", "SpikeBudget", "SpikeConfig",
           "StorageConfig", "SweepConfig", "TokenizerConfig", "TrainConfig", "PRESETS",
           "deep_merge", "dotted_to_nested", "plan_layout", "preset"]

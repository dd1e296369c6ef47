"""The run spec: `RunSpec`, the one root config of a run, and its sections (DESIGN §9).

Stdlib only — the workflow sandbox imports it. `RunSpec.from_dict` (spec/codec.py) is the
only way JSON or TOML becomes a spec.
"""

from spec.run import *  # noqa: F403 (the package's public names are spec.run's __all__)
from spec.run import __all__  # noqa: F401

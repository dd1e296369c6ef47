"""`python -m trainer.prebuild`: build the JIT ops a trainer loads at start, once, at
install time (`make install`), so that no trainer builds them while it trains
(trainer/extensions.py, `build_ops`)."""

from __future__ import annotations

import os

from trainer.extensions import build_ops


def main() -> int:
    built = build_ops()
    print(f"built {', '.join(built)} in {os.environ['TORCH_EXTENSIONS_DIR']}" if built
          else "no JIT op to build for this accelerator")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

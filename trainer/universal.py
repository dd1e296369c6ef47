"""`python -m trainer.universal ARGS…`: DeepSpeed's `ds_to_universal` converter (its own
arguments), with every file it loads read weights-only.

The converter unpickles each file it reads with `torch.load(weights_only=False)`, and the
files are the bucket's: a crafted optimizer shard that the rank's loader refuses ran its
payload here. This process forces weights-only loading (torch honours
TORCH_FORCE_WEIGHTS_ONLY_LOAD over an explicit weights_only=False), installs the rank's
allow-list of DeepSpeed classes (trainer/safe_load.py; an allow-list does not cross a
process boundary), and reads every input file through the bounded loader first, as the
rank did (DeepSpeed's own loads are not bounded). trainer/elastic.py starts it. Exit 0:
converted; 3: a file was refused (one `refused` JSON line on stdout says why) — unsafe, or
files that load but do not convert (a shard missing, a key or shape the converter does not
find: the files' doing, the same on every retry, so a corrupt checkpoint and not a crash
retried); anything else (out of memory, an I/O error: this machine's state) a crash.
"""

from __future__ import annotations

import json
import os
import pickle
import sys

from trainer.safe_load import (
    UnsafeCheckpointFile,
    first_line,
    force_weights_only,
    safe_torch_load,
)

EXIT_REFUSED = 3
REFUSED = "refused "


def main(argv: list[str]) -> int:
    force_weights_only()
    from deepspeed.checkpoint import ds_to_universal

    sys.argv = ["ds_to_universal", *argv]
    args = ds_to_universal.parse_arguments()
    try:
        for name in sorted(os.listdir(args.input_folder)):  # bounded, as in the rank
            if name.endswith(".pt"):
                safe_torch_load(os.path.join(args.input_folder, name), mmap=True)
        ds_to_universal.main(args)
    except UnsafeCheckpointFile as exc:
        return refused(f"{os.path.basename(exc.path)}: {exc.reason}")
    except pickle.UnpicklingError as exc:  # torch's refusal of a global: nothing of it ran
        return refused(first_line(exc))
    except (MemoryError, OSError):  # this machine's state, not the files' (safe_load.py)
        raise
    except Exception as exc:  # noqa: BLE001 — the files' contents: the same on every retry
        return refused(f"{args.input_folder} does not convert: {type(exc).__name__}: "
                       f"{first_line(exc)[:300]}")
    return 0


def refused(reason: str) -> int:
    print(REFUSED + json.dumps({"reason": reason}), flush=True)
    return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

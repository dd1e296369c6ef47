"""`python -m trainer.universal ARGS…`: DeepSpeed's `ds_to_universal` converter (its own
arguments), with every file it loads read weights-only.

The converter unpickles each file it reads with `torch.load(weights_only=False)`, and the
files are the bucket's: a crafted optimizer shard ran its payload here although the
rank's own loader had refused it. This process forces weights-only loading (torch honours
TORCH_FORCE_WEIGHTS_ONLY_LOAD over an explicit weights_only=False) and installs the same
allow-list of DeepSpeed classes as the rank (trainer/safe_load.py) — an allow-list does
not cross a process boundary. trainer/elastic.py starts it. Exit 0: converted; 3: a file
was refused (one `refused` JSON line on stdout says why); anything else: a crash.
"""

from __future__ import annotations

import json
import pickle
import sys

from trainer.safe_load import first_line, force_weights_only

EXIT_REFUSED = 3
REFUSED = "refused "


def main(argv: list[str]) -> int:
    force_weights_only()
    from deepspeed.checkpoint import ds_to_universal

    sys.argv = ["ds_to_universal", *argv]
    args = ds_to_universal.parse_arguments()
    try:
        ds_to_universal.main(args)
    except pickle.UnpicklingError as exc:  # torch's refusal of a global: nothing of it ran
        print(REFUSED + json.dumps({"reason": first_line(exc)}), flush=True)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

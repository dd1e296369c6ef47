"""`python -m tests.common.pickle_probe PAYLOAD OUT [ENTRY]`: what a child of mainspring does
when one of DeepSpeed's tools unpickles a file — `torch.load(PAYLOAD, weights_only=False)` —
and whether that was refused, as JSON in OUT. With ENTRY (`trainer.evaluate`,
`trainer.export`), that entry point's `main` runs first, on a spec that does not exist (it
stops at once, exit 3), so the load runs with the loader that entry point sets up."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys

import torch


def run_entry(module: str, scratch: str) -> int:
    args = ["--spec", os.path.join(scratch, "no-spec.json"), "--dataset", "unused",
            "--workdir", scratch, "--out", os.path.join(scratch, "unused")]
    args += ["--steps", "0"] if module == "trainer.evaluate" else ["--step", "0"]
    return importlib.import_module(module).main(args)


def main(argv: list[str]) -> None:
    payload, out = argv[0], argv[1]
    entry_rc = run_entry(argv[2], os.path.dirname(out)) if len(argv) > 2 else None
    try:
        torch.load(payload, map_location="cpu", weights_only=False)
        refused = None
    except pickle.UnpicklingError as exc:
        refused = str(exc)[:400]
    with open(out, "w") as f:
        json.dump({"refused": refused, "entry_rc": entry_rc,
                   "forced": os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")}, f)


if __name__ == "__main__":
    main(sys.argv[1:])

"""`mainspring plan`'s command line: flags, their errors (exit 2, naming the flag and the
fix), and the plan as text or one JSON object (ops/plan.py computes it)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from common.errors import BadConfig
from ops.plan import LAYOUTS, PlanInputs, chinchilla_tokens, plan
from ops.plan_facts import ACCELERATORS, BOUNDS, CHINCHILLA_SOURCE, bound_problem, bound_text

SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def number(flag: str, text: str | None, *, whole: bool = False) -> float | None:
    """A flag's number: 7e9, 7B, 15.6T, 2M (k, M, B or G, T); None when not given."""
    if text is None:
        return None
    raw = text.strip()
    scale = SUFFIXES.get(raw[-1:].lower(), 1.0) if raw else 1.0
    body = raw[:-1] if scale != 1.0 else raw
    try:
        value = float(body) * scale
    except ValueError:
        raise BadConfig(flag, f"{text!r} is not a number",
                        "give a number such as 7e9 or 7B (suffixes k, M, B, T)") from None
    if not math.isfinite(value) or value <= 0:
        raise BadConfig(flag, f"{text!r} is not a positive number", "give a number above 0")
    bound = BOUNDS.get(flag)
    if bound and (problem := bound_problem(flag, value)):  # before any arithmetic on it
        raise BadConfig(flag, problem, f"give {flag} in {bound_text(bound)}")
    if whole and value != int(value):
        raise BadConfig(flag, f"{text!r} is not a whole number", "give a count such as 8")
    return value


def price_range(text: str) -> tuple[float, float | None]:
    """--hour-price P or LOW..HIGH."""
    low, sep, high = text.partition("..")
    first = number("--hour-price", low)
    return (first or 0.0), (number("--hour-price", high) if sep else None)


def inputs_from(args: argparse.Namespace) -> PlanInputs:
    params = number("--params", args.params)
    if args.tokens is None:
        raise BadConfig("--tokens", "missing", "give a token count (e.g. 2T) or 'chinchilla'")
    try:
        tokens = (chinchilla_tokens(params) if args.tokens.strip().lower() == "chinchilla"
                  else number("--tokens", args.tokens))
    except BadConfig as exc:
        raise BadConfig("--tokens", exc.problem, "give a token count such as 2T or 2e12, or "
                        "'chinchilla' for 20 tokens per parameter") from None
    low, high = price_range(args.hour_price)
    whole = {k: number(f"--{k.replace('_', '-')}", getattr(args, k), whole=True)
             for k in ("accelerators", "tp", "pp", "layers", "d_model", "seq_len", "mfu_at",
                       "nodes_of", "cores")}
    ints = {k: int(v) if v is not None else None for k, v in whole.items()}
    real = {k: number(f"--{k.replace('_', '-')}", getattr(args, k))
            for k in ("mtbf_hours", "checkpoint_s", "restart_s", "peak_tflops", "batch_tokens",
                      "api_price_in", "api_price_out", "api_tokens_per_month")}
    fractions = {k: fraction(f"--{k.replace('_', '-')}", getattr(args, k))
                 for k in ("mfu", "goodput", "overlap", "api_output_share")}
    measured = measured_mfu(args, fractions, ints, real)
    return PlanInputs(params=params, tokens=tokens, accelerator=args.accelerator.lower(),
                      accelerators=ints.pop("accelerators"), hour_price=low,
                      hour_price_high=high, layout=args.layout, tp=ints.pop("tp") or 1,
                      pp=ints.pop("pp") or 1, per_node=ints.pop("nodes_of"), **ints, **real,
                      **fractions, **measured)


def throughput_mfu(path: str) -> dict:
    """--mfu-from-throughput: the MFU `benchmarks/throughput.py` measured (its JSON line,
    the last `throughput` figure in the file: a gpu_check.jsonl holds several), on one
    accelerator, against the peak it used; the file's MFU spread is its step times'."""
    flag = "--mfu-from-throughput"
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise BadConfig(flag, f"cannot read {path}: {exc.strerror}",
                        "give the file benchmarks/throughput.py's JSON line was saved to") from None
    lines = []
    for raw in text.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("figure") == "throughput" and line.get("mfu"):
            lines.append(line)
    if not lines:
        raise BadConfig(flag, f"{path} holds no throughput figure with an MFU",
                        "run benchmarks/throughput.py and save its JSON line to the file")
    got = lines[-1]
    fastest, slowest = got.get("step_time_spread") or [got["step_time_s"]] * 2
    scale = got["step_time_s"]
    return {"mfu": got["mfu"], "at": 1, "peak_tflops": got["peak_tflops"],
            "low": got["mfu"] * scale / slowest, "high": got["mfu"] * scale / fastest,
            "source": f"benchmarks/throughput.py on {got.get('device', '?')} (model "
                      f"{got.get('model', '?')}, {got.get('rows', '?')} rows, against "
                      f"{got.get('peak_source', '?')})"}


def measured_mfu(args: argparse.Namespace, fractions: dict, ints: dict, real: dict) -> dict:
    """--mfu-from-run / --mfu-from-throughput: a measured MFU, its range and source,
    measured on the run's accelerators (the benchmark's one) unless --mfu-at says
    otherwise, against the peak it was measured against unless --peak-tflops says
    otherwise. Sets those in `fractions`, `ints` and `real`."""
    run, bench = getattr(args, "mfu_from_run", None), getattr(args, "mfu_from_throughput", None)
    if not (run or bench):
        return {}
    flag = "--mfu-from-run" if run else "--mfu-from-throughput"
    if run and bench:
        raise BadConfig(flag, "given with --mfu-from-throughput", "give one of the two")
    if fractions["mfu"] is not None:
        raise BadConfig(flag, "given with --mfu", "give one of the two")
    if run:
        from ops.plan_run import mfu_from_run

        got = mfu_from_run(args.store, run)
    else:
        got = throughput_mfu(bench)
    fractions["mfu"] = got["mfu"]
    ints["mfu_at"] = ints["mfu_at"] or got["at"]
    real["peak_tflops"] = real["peak_tflops"] or got["peak_tflops"]
    return {"mfu_low": got["low"], "mfu_high": got["high"], "mfu_source": got["source"],
            "mfu_from": flag}


def fraction(flag: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise BadConfig(flag, f"{text!r} is not a number", "give a fraction such as 0.4") from None


def cmd_plan(args: argparse.Namespace) -> int:
    if args.from_run:
        from ops.plan_run import cmd_from_run

        return cmd_from_run(args)
    for flag in ("params", "accelerators", "accelerator", "hour_price"):
        if getattr(args, flag) is None:
            name = "--" + flag.replace("_", "-")
            raise BadConfig(name, "missing", f"give {name} (see 'mainspring plan --help')")
    result = plan(inputs_from(args))
    if args.tokens.strip().lower() == "chinchilla":
        result["defaults"].insert(0, {"input": "--tokens", "value": result["inputs"]["tokens"],
                                      "source": CHINCHILLA_SOURCE})
    if args.json:
        from ops.cli_output import json_line

        print(json_line(result))
    else:
        sys.stdout.write(render(result))
    return 0


def _e(x: float) -> str:
    return f"{x:.3g}"


def render(p: dict) -> str:
    """The plan as text: the figures, then every default with its source."""
    c, lay, s, g = p["compute"], p["layout"], p["scaling"], p["goodput"]
    wall, ah, cost = p["wall_hours"], p["accelerator_hours"], p["cost_usd"]
    lines = [
        f"plan: {_e(p['inputs']['params'])} parameters, {_e(p['inputs']['tokens'])} tokens on "
        f"{p['inputs']['accelerators']} x {p['inputs']['accelerator']}",
        f"compute       {_e(c['total_flops'])} FLOPs ({_e(c['flops_per_token'])} per token: 6N + "
        f"12·L·d·T, L={c['layers']} d={c['d_model']} T={c['seq_len']})",
        f"peak, MFU     {c['peak_tflops']:g} TFLOP/s; MFU {c['mfu']:.3f} (range "
        f"{c['mfu_range'][0]:.3f}-{c['mfu_range'][1]:.3f}) measured on {c['mfu_at']}",
        f"layout        {lay['name']} TP {lay['tp']} x PP {lay['pp']} x DP {lay['dp']} ({lay['why']})",
        f"step          {s['step_s']:.3g} s: compute {s['compute_s']:.3g} s"
        + (f" (of it the pipeline's bubble {s['bubble_fraction']:.1%}, 1F1B)"
           if s["bubble_fraction"] else "")
        + (f" (each rank on {s['core_share']:.2f} of a core)" if s["core_share"] < 1 else "")
        + " + exposed "
        f"communication {s['exposed_s']:.3g} s (DP {s['dp_s']:.3g}, TP {s['tp_s']:.3g}, "
        f"PP {s['pp_s']:.3g} s)",
        f"scaling       speed-up {s['speedup']:.1f}x from 1 to {p['inputs']['accelerators']}; "
        f"linear-scaling ratio {s['linear_ratio']:.3f}; MFU at scale {s['mfu']:.3f}",
        f"failures      job MTBF {g['job_mtbf_s'] / 3600:.3g} h; checkpoint every "
        f"{g['interval_s']:.0f} s (Young {g['young_interval_s']:.0f} s); badput "
        + ", ".join(f"{k} {v:.1%}" for k, v in g["badput"].items())
        + f"; goodput {g['goodput']:.1%}; ~{p['failures_expected']:.0f} failures",
        f"wall time     {wall['expected'] / 24:.3g} days ({wall['low'] / 24:.3g}-"
        f"{wall['high'] / 24:.3g})",
        f"accel-hours   {_e(ah['expected'])} ({_e(ah['low'])}-{_e(ah['high'])})",
        f"cost          ${_e(cost['expected'])} (${_e(cost['low'])}-${_e(cost['high'])})",
    ]
    if p["build_vs_buy"]:
        b = p["build_vs_buy"]
        months = b["break_even_months"]
        lines.append(f"build vs buy  the API bill is ${_e(b['monthly_bill_usd'])} a month: "
                     f"training costs {months['expected']:.3g} months of it "
                     f"({months['low']:.3g}-{months['high']:.3g})")
    lines.append("defaults:")
    lines += [f"  {d['input']} = {d['value']:g}: {d['source']}" for d in p["defaults"]]
    return "\n".join(lines) + "\n"


def register(sub: argparse._SubParsersAction) -> None:
    """Add `plan` (mainspring plan --params N --tokens T ... | --from-run RUN)."""
    p = sub.add_parser("plan", help="wall time, cost, scaling and build-versus-buy of a run "
                                    "before it starts, each default with its source")
    p.add_argument("--params", help="parameters, e.g. 7e9 or 7B")
    p.add_argument("--tokens", help="training tokens (e.g. 2T), or 'chinchilla' (20 per parameter)")
    p.add_argument("--accelerators", help="how many accelerators (G)")
    p.add_argument("--accelerator", help=f"one of {', '.join(ACCELERATORS)}")
    p.add_argument("--hour-price", help="USD per accelerator-hour, or a range LOW..HIGH")
    p.add_argument("--mtbf-hours", help="hours between failures of ONE accelerator "
                                        "(the job's MTBF is this / G)")
    p.add_argument("--checkpoint-s", help="seconds one checkpoint save stalls training")
    p.add_argument("--restart-s", help="seconds from a failure to training again")
    p.add_argument("--mfu", help="model-FLOPs utilization, end to end (0-1]")
    p.add_argument("--mfu-at", help="accelerators --mfu was measured on (default: G)")
    p.add_argument("--mfu-from-run", metavar="RUN",
                   help="take the MFU a recorded run measured (its train_metrics windows; "
                        "its accelerators and configured peak) from --store")
    p.add_argument("--mfu-from-throughput", metavar="FILE",
                   help="take the MFU benchmarks/throughput.py measured on one accelerator "
                        "(its JSON line saved to FILE; a gpu_check.jsonl works)")
    p.add_argument("--peak-tflops", help="dense bf16 peak per accelerator")
    p.add_argument("--layout", default="auto", choices=LAYOUTS)
    p.add_argument("--tp", help="tensor-parallel degree")
    p.add_argument("--pp", help="pipeline-parallel degree")
    p.add_argument("--nodes-of", help="accelerators per node")
    p.add_argument("--cores", help="a CPU host's cores (--accelerator cpu): its ranks beyond "
                                   "them share them")
    p.add_argument("--layers", help="transformer layers (for the attention FLOPs)")
    p.add_argument("--d-model", help="model width")
    p.add_argument("--seq-len", help="tokens per sequence")
    p.add_argument("--batch-tokens", help="tokens per optimizer step")
    p.add_argument("--overlap", help="fraction of gradient traffic hidden behind backward")
    p.add_argument("--goodput", help="a known goodput (0-1], instead of the failure model")
    p.add_argument("--api-price-in", help="API USD per million input tokens")
    p.add_argument("--api-price-out", help="API USD per million output tokens")
    p.add_argument("--api-tokens-per-month", help="tokens the API would serve a month")
    p.add_argument("--api-output-share", help="share of those tokens that are output")
    p.add_argument("--from-run", help="predict a recorded run's wall time from its first "
                                      "10%% of steps, against what it took")
    p.add_argument("--store", "--durable", dest="store", default=".mainspring/store",
                   help="durable storage URL of --from-run and --mfu-from-run")
    p.add_argument("--json", action="store_true", help="the plan as one JSON object")
    p.set_defaults(fn=cmd_plan)

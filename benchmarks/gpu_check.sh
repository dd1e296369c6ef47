#!/usr/bin/env bash
# GPU acceptance checks for the trainer, on one CUDA machine, in one prepared run:
#   1. packed attention: SDPA (fp32, bf16) and flash-attn varlen (if importable) — each
#      document of a packed row matches the document run alone; then the 1B model's
#      attention shapes through each SDPA variant the model can call, with the fused
#      kernels torch finds eligible for each and its forward+backward time;
#   2. a short bf16 segment (NCCL, ZeRO 2) killed with SIGKILL after a commit and resumed,
#      against an uninterrupted run and a second uninterrupted run (the kernels' run-to-run
#      noise): bitwise, or within 4x that noise, and which; peak memory per rank;
#   3. throughput, step time, peak memory and MFU of the ~1B-parameter model in bf16, against
#      the datasheet dense bf16 peak (H200: 989 TFLOP/s) and a measured 8192² matmul
#      ceiling, one document per row (SDPA's flash kernel);
#   4. the same 1B throughput with packed rows (training's block-causal attention), eager
#      and with each block compiled (model.compile);
#   5. the checkpoint stall ratio with a 4 GiB state on the GPU (the trainer's hand-over: a
#      save to local disk, then the writer process hashes and commits to the durable tier);
#   6. TP 2 over NCCL against one rank holding the whole model, per-step losses (two GPUs:
#      NCCL runs one rank per device; skipped, saying so, on one);
#   7. if the time budget still allows: the stall with the in-memory hand-over, and the
#      causal 1B run compiled.
# Prints one JSON line per figure on stdout (progress on stderr). A failed check prints a
# line with "failed" and the next check still runs (one device run yields every figure it
# can); the exit status is 1 if any failed, 2 without CUDA. GPU_CHECK_CPU_DRYRUN=1 runs the
# same code on CPU (fp32, tiny sizes, gloo): the script's own test.
# On a machine whose image has CUDA PyTorch but not the trainer's other dependencies, run
# benchmarks/gpu/wheels.sh here first; this script installs .whl/ into a private directory
# when those dependencies are missing. The device command (docs/design.md, "GPU checks"):
#   set -o pipefail; PYTHONUNBUFFERED=1 GPU_CHECK_BUDGET_S=300 bash benchmarks/gpu_check.sh \
#     2> >(tee $OUT/gpu_check.err >&2) | tee $OUT/gpu_check.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3  # a device image: its python3 holds the CUDA torch
BUDGET=${GPU_CHECK_BUDGET_S:-300}  # optional part 6 runs only if this much time is left
START=$SECONDS
export PYTHONPATH=$PWD
missing=$("$PY" - <<'PYEOF'
import importlib.util as u
def have(name):
    try:
        return u.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False
print(" ".join(n for n in ("deepspeed", "structlog", "pydantic", "hjson", "opentelemetry.sdk") if not have(n)))
PYEOF
)
if [[ -n "$missing" ]]; then
  compgen -G ".whl/*.whl" >/dev/null \
    || { echo "gpu_check: FAILED — $PY lacks: $missing; run benchmarks/gpu/wheels.sh where pip works and carry .whl/" >&2; exit 2; }
  SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH=$PWD:$SITE
  echo "gpu_check: installed $(ls .whl | wc -l) wheels into $SITE for: $missing" >&2
fi
if [[ "${GPU_CHECK_CPU_DRYRUN:-0}" != 1 ]]; then
  "$PY" -c 'import sys, torch; ok = torch.cuda.is_available(); print("gpu_check: torch", torch.__version__, "CUDA", ok and torch.cuda.get_device_name(0), file=sys.stderr); sys.exit(0 if ok else 2)' \
    || { echo "gpu_check: FAILED — no CUDA device (this check needs a GPU)" >&2; exit 2; }
  DRY=0
else
  export DS_ACCELERATOR=cpu
  DRY=1
fi
part() { echo "== $1 (at $((SECONDS - START)) s)" >&2; }
left() { (( BUDGET - (SECONDS - START) >= $1 )); }
FAILED=()
# check NAME CMD...: a failed or hung check (past CHECK_TIMEOUT_S) is reported as a line
# with "failed", and the next one still runs.
CHECK_TIMEOUT_S=${GPU_CHECK_TIMEOUT_S:-180}
check() {
  local name=$1; shift
  if ! timeout --kill-after=5 "$CHECK_TIMEOUT_S" "$@"; then
    FAILED+=("$name")
    echo "{\"figure\": \"$name\", \"failed\": true, \"command\": \"$*\"}"
  fi
}
if (( DRY )); then
  SIZE=(--size tiny --steps 2 --warmup 1)
  STALL=(--mb 24 --checkpoints 2 --every 10 --batch 64 --width 512)
else  # the stall's state: 4 GiB of weights and Adam moments, 21 layers of 4096², fp32
  SIZE=(--size 1b --steps 20 --warmup 3)
  STALL=(--device cuda --mb 4096 --checkpoints 2 --every 40 --batch 4096 --width 4096)
fi
DURABLE=$(mktemp -d -t gpu_check_durable_XXXX)
trap 'rm -rf "$DURABLE"' EXIT

part "1. packed attention kernels"
check packed_attention_exact "$PY" benchmarks/gpu/parts.py attention
check sdpa_variants "$PY" benchmarks/gpu/parts.py sdpa

part "2. bf16 segment, SIGKILL after a commit, resume"
check gpu_kill_resume "$PY" benchmarks/gpu/parts.py kill-resume

part "3. throughput of the ~1B model, one document per row (SDPA flash)"
check throughput "$PY" benchmarks/throughput.py "${SIZE[@]}" --rows causal

part "4. throughput of the ~1B model, packed rows (training's attention), eager and compiled"
check throughput "$PY" benchmarks/throughput.py "${SIZE[@]}" --rows packed
check throughput "$PY" benchmarks/throughput.py "${SIZE[@]}" --rows packed --compile

part "5. checkpoint stall, state on the device, saved to local disk as the trainer does"
check checkpoint_stall_ratio "$PY" benchmarks/checkpoint_stall.py "${STALL[@]}" --snapshot disk \
  --durable "file://$DURABLE/disk"

part "6. tensor parallelism: TP 2 over NCCL against one rank (skipped with one GPU)"
check gpu_tp2 "$PY" benchmarks/gpu/parts.py tp2

part "7. optional, by the budget left ($BUDGET s in all)"
if left 60; then
  check checkpoint_stall_ratio "$PY" benchmarks/checkpoint_stall.py "${STALL[@]}" \
    --snapshot memory --durable "file://$DURABLE/memory"
else
  echo '{"figure": "checkpoint_stall_ratio", "snapshot": "memory", "skipped": "time budget"}'
fi
if left 30; then
  check throughput "$PY" benchmarks/throughput.py "${SIZE[@]}" --rows causal --compile
else
  echo '{"figure": "throughput", "rows": "causal", "compiled": true, "skipped": "time budget"}'
fi
if (( ${#FAILED[@]} )); then
  echo "gpu_check: FAILED after $((SECONDS - START)) s: ${FAILED[*]}" >&2
  exit 1
fi
echo "gpu_check: all checks passed in $((SECONDS - START)) s" >&2

#!/usr/bin/env bash
# Data-parallel scaling efficiency (issue #8's benchmark): the same pretraining run on 1 GPU and on
# N GPUs of this host (`fourbit launch -n N -- pretrain ...`), the same micro-batches per GPU
# (--grad-accum A on one rank, N x A over N ranks), and
#   efficiency = (tokens/s at N) / (N x tokens/s at 1),
# tokens/s from the median step time in rank 0's metrics.jsonl over the steps after --skip
# (warm-up: cuBLASLt heuristics, first allocations). BENCHMARKS.md's target: >= 90% at 8 GPUs.
#
# Usage: tools/dist-scaling.sh [-n N] [--preset P] [--recipe R] [--steps S] [--skip K]
#                              [--grad-accum A] [-b B] [-t T] [--device D] [--fourbit PATH]
#                              [--out DIR] [-- extra pretrain options]
# Defaults: N = the GPUs nvidia-smi lists, gpt2-124m, bf16, 20 steps, skip 5, A 1, B 32, T 1024,
# cuda, build-gpu/src/cli/fourbit, /tmp/fourbit-scaling. Prints one line per run and the efficiency;
# with N = 1 it runs the one-GPU leg only (a check of the script on any machine, --device cpu too).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
preset=gpt2-124m recipe=bf16 steps=20 skip=5 accum=1 batch=32 seq=1024 device=cuda
fourbit=$root/build-gpu/src/cli/fourbit out=/tmp/fourbit-scaling
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n) n=$2; shift 2 ;;
    --preset) preset=$2; shift 2 ;;
    --recipe) recipe=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --skip) skip=$2; shift 2 ;;
    --grad-accum) accum=$2; shift 2 ;;
    -b) batch=$2; shift 2 ;;
    -t) seq=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --fourbit) fourbit=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "dist-scaling.sh: unknown argument '$1' (see the usage at the top of the script)" >&2; exit 2 ;;
  esac
done
[ "${n:-0}" -ge 1 ] || { echo "dist-scaling.sh: no GPU found; give -n N" >&2; exit 2; }
[ -x "$fourbit" ] || { echo "dist-scaling.sh: no fourbit binary at $fourbit (--fourbit PATH)" >&2; exit 2; }
[ "$steps" -gt "$skip" ] || { echo "dist-scaling.sh: --steps must exceed --skip" >&2; exit 2; }

# Median step time of rank 0's metrics after the warm-up steps: prints "seconds tokens_per_step".
median_step() {
  python3 - "$1" "$skip" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"train"' in l]
rows = [r for r in rows if r.get("type") == "train" and r["step"] > int(sys.argv[2]) and not r.get("skipped")]
if not rows:
    sys.exit("no timed steps in " + sys.argv[1])
per_step = [b["tokens"] - a["tokens"] for a, b in zip(rows, rows[1:])] or [rows[0]["tokens"] // rows[0]["step"]]
print(statistics.median(r["step_seconds"] for r in rows), per_step[0])
EOF
}

run_leg() {  # ranks -> "tokens_per_second"
  local ranks=$1 dir=$out/$1
  rm -rf "$dir"
  local args=(pretrain --preset "$preset" --recipe "$recipe" --device "$device" --steps "$steps"
              --grad-accum $((accum * ranks)) -b "$batch" -t "$seq" --eval-every 0 --out "$dir"
              "${extra[@]}")
  if [ "$ranks" -eq 1 ]; then
    "$fourbit" "${args[@]}" >"$out/log-$ranks.txt" 2>&1
  else
    "$fourbit" launch -n "$ranks" -- "${args[@]}" >"$out/log-$ranks.txt" 2>&1
  fi
  read -r seconds tokens < <(median_step "$dir/metrics.jsonl")
  python3 -c "import sys; s, t = float(sys.argv[1]), float(sys.argv[2]); print(f'{t / s:.1f}')" "$seconds" "$tokens"
  echo "$ranks rank(s): median step $seconds s, $tokens tokens a step (log: $out/log-$ranks.txt)" >&2
}

mkdir -p "$out"
echo "dist-scaling: $preset, recipe $recipe, B $batch x T $seq, $accum micro-batch(es) per GPU a step, $steps steps (first $skip not timed)"
one=$(run_leg 1)
echo "1 GPU: $one tokens/s"
if [ "$n" -gt 1 ]; then
  many=$(run_leg "$n")
  python3 -c "import sys; a, b, n = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]); print(f'{n} GPUs: {b} tokens/s = {b / n:.1f} per GPU; scaling efficiency {b / (n * a):.3f} (target >= 0.90 at 8 GPUs)')" "$one" "$many" "$n"
fi

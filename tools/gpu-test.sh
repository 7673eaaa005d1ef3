#!/usr/bin/env bash
# The GPU test run, for a machine with an NVIDIA GPU (made for the nvidia-h200 device machine:
# Ubuntu 24.04, CUDA 13.0, every build dependency preinstalled, no network). Builds fourbit with
# CUDA into build-gpu/, prints the GPU, runs every `gpu`-labelled test, then the `cpu` tests, then
# the benchmarks. It does not stop at a failure: every step runs, a table of (step, status,
# seconds) comes last, and the exit code is non-zero if any step failed.
#
#   tools/gpu-test.sh
#
# Files written to $OUT (or build-gpu/gpu-test-out/ when OUT is unset); at most 8, because the
# device tool brings back no more:
#   build.log                    cmake configure + build
#   test.log                     ctest -L gpu, then ctest -L cpu
#   bench.log                    every benchmark's console output
#   bench.csv                    every benchmark's CSV, each row prefixed with the benchmark's name
#                                (a header row starts each benchmark's block)
#   summary.txt                  machine, commit and the step table
#   results-<date>-<commit>.md   commit, GPU, driver, CUDA, date and every benchmark table: copy it
#                                into bench/results/ (see bench/results/README.md)
#   ktrace.txt                   with FOURBIT_TRACE only: tools/ktrace's per-kernel table and idle gaps
#
# Environment:
#   FOURBIT_GPU_BUILD_DIR  build folder (default: build-gpu/ in the repository)
#   FOURBIT_CMAKE_ARGS     extra cmake arguments, e.g. "-DFOURBIT_CUDA_GENCODE=..."
#   FOURBIT_COMMIT         the commit to report, where git cannot read it (the device machine
#                          gets a copy of the working tree whose .git it cannot use)
#   FOURBIT_BENCHES        space-separated benchmark names to run (default: all of them); "none"
#                          runs none. A run that must fit a time limit splits them over calls.
#                          "anchor" (in "all" too) is BENCHMARKS.md's PyTorch training-step anchor
#                          (tools/torch_train_anchor.py, where torch imports); with "train" in the
#                          same run the results file gives fourbit bf16's ratio to it.
#   FOURBIT_SKIP           space-separated steps to skip: test-cpu, torch-check (the gpu tests and
#                          the build are never skipped)
#   FOURBIT_GPU_TEST_JOBS  gpu tests run at once on the one GPU (default 1; more saves time when
#                          device time is short: no test is timed, and they fit the GPU's memory)
#   FOURBIT_GPU_TEST_TIMEOUT  seconds after which ctest stops a gpu test (default 600): a kernel
#                          that hangs fails its test instead of using up the device call
#   FOURBIT_GPU_TESTS      a ctest regular expression: only the gpu tests it matches run (default:
#                          all), e.g. "test_quant_cuda|test_model_cuda" when device time is short
#   FOURBIT_TRACE          fourbit arguments to run once under tools/ktrace (loaded through
#                          CUDA_INJECTION64_PATH) after the tests, e.g. "bench train --presets
#                          gpt2-124m --recipes bf16 --warmup 1 --steps 3"; the table goes to ktrace.txt
set -u -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${FOURBIT_GPU_BUILD_DIR:-$root/build-gpu}
out=${OUT:-$build/gpu-test-out}
jobs=$(nproc)
fourbit="$build/src/cli/fourbit"
mkdir -p "$build" "$out" "$build/bench"

# The benchmarks, one line each: "<name> <fourbit arguments>". Each run also gets
# `--csv build-gpu/bench/<name>.csv`; append a line here for every new benchmark.
benches=(
  "quant bench quant"
  "gemm bench gemm"
  "attention bench attention"
  "moe bench moe"
  "model bench model"
  "decode bench decode"
  "sample-bf16 sample --preset gpt2-124m --device cuda --sampler-recipe bf16 --n 64 --max-new-tokens 64 --stop none --quiet --prompt 12+34="
  "sample-nvfp4 sample --preset gpt2-124m --device cuda --sampler-recipe nvfp4 --n 64 --max-new-tokens 64 --stop none --quiet --prompt 12+34="
  "rl-bf16 rl --device cuda --sampler-recipe bf16 --task add:digits=1 --steps 8 --prompts 8 --group 8 --eval-prompts 0 --out /tmp/fourbit-rl-bench"
  "rl-nvfp4 rl --device cuda --sampler-recipe nvfp4 --task add:digits=1 --steps 8 --prompts 8 --group 8 --eval-prompts 0 --out /tmp/fourbit-rl-bench"
  "sample-nvfp4w sample --preset gpt2-124m --device cuda --sampler-recipe nvfp4-weights --n 64 --max-new-tokens 64 --stop none --quiet --prompt 12+34="
  "rl-nvfp4w rl --device cuda --sampler-recipe nvfp4-weights --task add:digits=1 --steps 8 --prompts 8 --group 8 --eval-prompts 0 --out /tmp/fourbit-rl-bench"
  "train bench train"
)
# The collectives' bus bandwidth between the GPUs of this host (issue #8), where there are several:
# `fourbit launch` starts one process per GPU, rank 0 writes the CSV.
n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${n_gpus:-0}" -ge 2 ]; then benches+=("comm launch -n $n_gpus -- bench comm"); fi

# --- identity of this run ------------------------------------------------------------------------
commit=${FOURBIT_COMMIT:-}
if [ -z "$commit" ] && commit=$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null); then
  changes=$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null) || changes=unknown
  [ -z "$changes" ] || commit="$commit-dirty"
fi
commit=${commit:-unknown}
date_utc=$(date -u '+%Y-%m-%d %H:%M UTC')
day=$(date -u +%Y-%m-%d)
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
gpu=${gpu:-no GPU visible (nvidia-smi failed)}
n_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
nvcc=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
cuda_version=$( [ -n "$nvcc" ] && "$nvcc" --version | sed -n 's/.*release \([0-9.]*\), \(V[0-9.]*\).*/nvcc \1 (\2)/p')
driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)
cuda="${cuda_version:-no nvcc found}; driver supports CUDA ${driver_cuda:-?}"

build_log="$out/build.log"
test_log="$out/test.log"
bench_log="$out/bench.log"
bench_csv="$out/bench.csv"
summary_txt="$out/summary.txt"
results_md="$out/results-$day-$commit.md"
: >"$build_log"; : >"$test_log"; : >"$bench_log"; : >"$bench_csv"

# --- steps ---------------------------------------------------------------------------------------
step_names=()
step_status=()
step_secs=()
failed=0

# step <name> <log> <lines to echo on success> <command...>: appends the command's output to the
# log, records status and seconds, echoes the output's last lines (more of them on failure).
step() {
  local name=$1 log=$2 show=$3
  shift 3
  local t0=$SECONDS part rc
  part=$(mktemp)
  printf '===== %s: %s\n' "$name" "$*" | tee -a "$log"
  "$@" >"$part" 2>&1
  rc=$?
  cat "$part" >>"$log"
  step_names+=("$name")
  step_secs+=($((SECONDS - t0)))
  if [ "$rc" -eq 0 ]; then
    step_status+=(ok)
    [ "$show" -gt 0 ] && tail -n "$show" "$part"
  else
    step_status+=("FAIL (exit $rc)")
    failed=1
    tail -n 40 "$part"
    echo "----- $name FAILED (exit $rc); full output in $log"
  fi
  rm -f "$part"
  return "$rc"
}

cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DFOURBIT_CUDA=ON --no-warn-unused-cli)
[ -n "$nvcc" ] && cmake_args+=(-DCMAKE_CUDA_COMPILER="$nvcc")
if command -v ccache >/dev/null 2>&1; then
  cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# OpenBLAS (the CPU GEMM backend) cannot be installed on a machine without network access: build
# without it there (its cpu test then skips) rather than fail the whole run, and say so.
blas_note="OpenBLAS found"
have_openblas_header=0
for f in /usr/include/*/openblas*/cblas.h /usr/include/openblas/cblas.h /usr/include/cblas.h; do
  [ -e "$f" ] && have_openblas_header=1
done
if [ "$have_openblas_header" -eq 1 ] && ldconfig -p 2>/dev/null | grep libopenblas >/dev/null; then
  cmake_args+=(-DFOURBIT_BLAS=ON)
else
  cmake_args+=(-DFOURBIT_BLAS=OFF)
  blas_note="OpenBLAS not installed: built with -DFOURBIT_BLAS=OFF (no cpu-blas GEMM backend)"
fi
read -r -a extra_args <<<"${FOURBIT_CMAKE_ARGS:-}"

echo "fourbit GPU test: commit $commit, $date_utc"
echo "GPU: $gpu ($n_gpus visible); CUDA: $cuda; $jobs CPU cores; $blas_note"
echo "logs and results: $out"

step configure "$build_log" 0 \
  cmake -S "$root" -B "$build" "${cmake_args[@]}" ${extra_args[@]+"${extra_args[@]}"}
step build "$build_log" 0 cmake --build "$build" -j "$jobs"
step gpu-info "$test_log" 20 \
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,power.limit \
  --format=csv
step test-gpu "$test_log" 3 \
  ctest --test-dir "$build" -L gpu --output-on-failure --no-tests=error -j "${FOURBIT_GPU_TEST_JOBS:-1}" \
    --timeout "${FOURBIT_GPU_TEST_TIMEOUT:-600}" ${FOURBIT_GPU_TESTS:+-R "$FOURBIT_GPU_TESTS"}
skip=" ${FOURBIT_SKIP:-} "
if [[ "$skip" != *" test-cpu "* ]]; then
  step test-cpu "$test_log" 3 \
    ctest --test-dir "$build" -L cpu --output-on-failure --no-tests=error -j "$jobs"
fi

# The PyTorch cross-check of the transformer (tools/torch_crosscheck.py), where torch is installed:
# fourbit's CPU float64 model, then its CUDA model, against an independent PyTorch model.
if [[ "$skip" == *" torch-check "* ]]; then
  echo "torch cross-check skipped: FOURBIT_SKIP has torch-check" | tee -a "$test_log"
elif python3 -c 'import torch, numpy' >/dev/null 2>&1; then
  step torch-check-cpu "$test_log" 40 python3 "$root/tools/torch_crosscheck.py" --fourbit "$fourbit"
  step torch-check-cuda "$test_log" 40 \
    python3 "$root/tools/torch_crosscheck.py" --fourbit "$fourbit" --device cuda
else
  echo "torch cross-check skipped: python3 cannot import torch and numpy" | tee -a "$test_log"
fi

if [ -n "${FOURBIT_TRACE:-}" ]; then
  read -r -a trace_args <<<"$FOURBIT_TRACE"
  step trace "$bench_log" 5 env FOURBIT_KTRACE_OUT="$out/ktrace.txt" \
    CUDA_INJECTION64_PATH="$build/tools/ktrace/libfourbit_ktrace.so" "$fourbit" "${trace_args[@]}"
fi

bench_names=()
wanted=" ${FOURBIT_BENCHES:-all} "
for line in "${benches[@]}"; do
  read -r name args <<<"$line"
  read -r -a args <<<"$args"
  [ "$wanted" = " all " ] || [[ "$wanted" == *" $name "* ]] || continue
  csv="$build/bench/$name.csv"
  rm -f "$csv"
  step "bench-$name" "$bench_log" 200 "$fourbit" "${args[@]}" --csv "$csv"
  if [ -s "$csv" ]; then
    sed "1s/^/bench,/; 2,\$s/^/$name,/" "$csv" >>"$bench_csv"
    bench_names+=("$name")
  fi
done

# BENCHMARKS.md's bf16 target is a ratio to a PyTorch + torch.compile step measured on an H200;
# measured here, on the machine of this run, the ratio means something on any GPU.
anchor_csv="$build/bench/anchor.csv"
rm -f "$anchor_csv"
if [ "$wanted" = " all " ] || [[ "$wanted" == *" anchor "* ]]; then
  if python3 -c 'import torch' >/dev/null 2>&1; then
    step bench-anchor "$bench_log" 3 python3 "$root/tools/torch_train_anchor.py" --csv "$anchor_csv"
    [ -s "$anchor_csv" ] && sed "1s/^/bench,/; 2,\$s/^/anchor,/" "$anchor_csv" >>"$bench_csv"
  else
    echo "anchor skipped: python3 cannot import torch" | tee -a "$bench_log"
  fi
fi

# --- reports -------------------------------------------------------------------------------------
csv_to_markdown() {  # CSV file -> markdown table (python3's csv module; awk if there is none)
  python3 - "$1" 2>/dev/null <<'EOF' ||
import csv, sys
rows = list(csv.reader(open(sys.argv[1], newline="")))
for i, row in enumerate(rows):
    print("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    if i == 0:
        print("|" + "---|" * len(row))
EOF
  awk -F, '{ gsub(/"/, ""); printf "|"; for (i = 1; i <= NF; i++) printf " %s |", $i; printf "\n" }
           NR == 1 { printf "|"; for (i = 1; i <= NF; i++) printf "---|"; printf "\n" }' "$1"
}
step_table() {
  printf '| step | status | seconds |\n|---|---|---|\n'
  for i in "${!step_names[@]}"; do
    printf '| %s | %s | %s |\n' "${step_names[$i]}" "${step_status[$i]}" "${step_secs[$i]}"
  done
}
gencode=$(sed -n 's/^FOURBIT_CUDA_GENCODE:STRING=//p' "$build/CMakeCache.txt" 2>/dev/null)
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null)
cxx_version=$([ -n "$cxx" ] && "$cxx" -dumpfullversion 2>/dev/null)

{
  echo "# fourbit GPU results: $day, commit $commit"
  echo
  echo "| | |"
  echo "|---|---|"
  echo "| commit | \`$commit\` |"
  echo "| GPU, driver | $gpu |"
  echo "| CUDA | $cuda |"
  echo "| date | $date_utc |"
  echo "| build | Release, \`${gencode:-?}\`, g++ ${cxx_version:-?} |"
  echo
  echo "Produced by \`tools/gpu-test.sh\`; how to read the tables: bench/results/README.md."
  echo
  echo "## Steps"
  echo
  step_table
  # ctest's verdict lines and the failed tests' names, so that this file alone tells the story
  # (the device tool may bring back only some of the files of $out).
  if grep -q "tests passed" "$test_log" 2>/dev/null; then
    echo
    echo "## Tests"
    echo
    grep -E "^[0-9]+% tests passed" "$test_log" | sed 's/^/- /'
    awk '/^The following tests FAILED:/ { on = 1; next } on && /^[[:space:]]+[0-9]+ - / { sub(/^[[:space:]]+/, ""); print "- failed: " $0; next } { on = 0 }' "$test_log"
  fi
  for name in "${bench_names[@]}"; do
    for line in "${benches[@]}"; do
      read -r n args <<<"$line"
      [ "$n" = "$name" ] || continue
      echo
      echo "## $name"
      echo
      echo "\`fourbit $args\`"
      echo
      csv_to_markdown "$build/bench/$name.csv"
    done
  done
  if [ -s "$anchor_csv" ]; then
    echo
    echo "## anchor"
    echo
    echo "\`python3 tools/torch_train_anchor.py\` (PyTorch + torch.compile, SDPA, fused AdamW, B 32 x T 1024)"
    echo
    csv_to_markdown "$anchor_csv"
    if [ -s "$build/bench/train.csv" ]; then
      echo
      python3 - "$build/bench/train.csv" "$anchor_csv" <<'EOF' || true
import csv, sys
train = [r for r in csv.DictReader(open(sys.argv[1])) if r["preset"] == "gpt2-124m" and r["recipe"] == "bf16"]
anchor = {r["arch"]: float(r["tokens_per_s"]) for r in csv.DictReader(open(sys.argv[2]))}
if train:
    ours = float(train[0]["tokens_per_s"])
    for arch, name in (("gpt2", "nanoGPT's GPT-2, the anchor BENCHMARKS.md names"),
                       ("fourbit", "fourbit's gpt2-124m architecture")):
        if arch in anchor:
            print(f"- fourbit bf16 gpt2-124m {ours:.0f} tokens/s over the anchor ({name}) "
                  f"{anchor[arch]:.0f}: {ours / anchor[arch]:.3f}x (target 1.1x)")
EOF
    fi
  fi
} >"$results_md"

{
  echo "fourbit GPU test: commit $commit, $date_utc"
  echo "GPU: $gpu ($n_gpus visible)"
  echo "CUDA: $cuda"
  echo "$blas_note"
  echo
  printf '%-16s %-16s %8s\n' step status seconds
  for i in "${!step_names[@]}"; do
    printf '%-16s %-16s %8s\n' "${step_names[$i]}" "${step_status[$i]}" "${step_secs[$i]}"
  done
  echo
  if [ "$failed" -eq 0 ]; then echo "ALL STEPS PASSED"; else echo "SOME STEPS FAILED"; fi
} >"$summary_txt"

echo
cat "$summary_txt"
echo "results for bench/results/: $results_md"
exit "$failed"

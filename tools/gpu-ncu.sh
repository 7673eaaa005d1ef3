#!/usr/bin/env bash
# One Nsight Compute profile of one kernel launch, in a GPU call (METHOD.md: profile before
# guessing). Builds the `fourbit` target of this tree into build-gpu/ (as tools/gpu-ab.sh does;
# reused when already built), then profiles the launch of the kernels whose demangled name matches
# REGEX, after skipping SKIP matching launches (warm-up ones), with real clocks and the full
# section set, and writes:
#   $OUT/NAME.txt          the details page (speed of light, memory, warp states, occupancy, ...)
#   $OUT/NAME-sass.csv     the source page: per SASS instruction, its stall samples and counters
# (without OUT: under ./ncu-out/). Call it once per kernel; the build is shared.
#
#   tools/gpu-ncu.sh NAME SKIP REGEX -- <fourbit arguments>
#
# Example: the NVFP4 lm_head GEMV at batch 1 (F = 1 is NVFP4, the bool is FP16 x, the int n-tiles;
# ncu spells template arguments as `(int)1`, `(bool)1`); --layers isolates one layer's launches:
#   tools/gpu-ncu.sh lmhead-nvfp4 2 \
#     'staged_kernel<\(fourbit::gemm::kernels::DecodeWeightFormat\)1, \(bool\)1, \(int\)1>' \
#     -- bench decode --no-steps --batches 1 --layers lm_head --reps 5
set -u -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ $# -lt 5 ] || [ "$4" != "--" ]; then
  echo "usage: tools/gpu-ncu.sh NAME SKIP REGEX -- <fourbit arguments> (see the top of tools/gpu-ncu.sh)" >&2
  exit 2
fi
name=$1 skip=$2 regex=$3
shift 4
case "$skip" in
  '' | *[!0-9]*) echo "gpu-ncu.sh: SKIP must be a non-negative integer, got '$skip'" >&2; exit 2 ;;
esac
out=${OUT:-$root/ncu-out}
mkdir -p "$out"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [ -z "$ncu" ]; then
  echo "gpu-ncu.sh: no ncu on PATH or in /usr/local/cuda/bin" >&2
  exit 1
fi

bin=$root/build-gpu/src/cli/fourbit
{  # incremental: a second call rebuilds nothing
  nvcc=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
  cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release --no-warn-unused-cli)
  [ -n "$nvcc" ] && cmake_args+=(-DFOURBIT_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc")
  mkdir -p "$root/build-gpu"
  cmake -S "$root" -B "$root/build-gpu" "${cmake_args[@]}" >"$root/build-gpu/gpu-ncu-configure.log" 2>&1 &&
    cmake --build "$root/build-gpu" --target fourbit -j "$(nproc)" >"$root/build-gpu/gpu-ncu-build.log" 2>&1 ||
    { echo "gpu-ncu.sh: build failed (logs under build-gpu/gpu-ncu-*.log)"; tail -n 30 "$root/build-gpu/gpu-ncu-build.log"; exit 1; }
}

rep=$(mktemp -d)/"$name"
"$ncu" --kernel-name-base demangled --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count 1 \
  --clock-control none --set full --import-source no -o "$rep" "$bin" "$@" >"$out/$name-run.log" 2>&1
rc=$?
if [ $rc -ne 0 ] || [ ! -f "$rep.ncu-rep" ]; then
  echo "gpu-ncu.sh: ncu exited $rc or wrote no report; its log:"
  tail -n 30 "$out/$name-run.log"
  exit 1
fi
rm -f "$out/$name-run.log"
"$ncu" -i "$rep.ncu-rep" --page details >"$out/$name.txt" 2>&1
"$ncu" -i "$rep.ncu-rep" --page source --csv --print-source sass >"$out/$name-sass.csv" 2>&1 ||
  echo "gpu-ncu.sh: this ncu could not print the source page" >>"$out/$name.txt"
echo "gpu-ncu.sh: $name: $(grep -E '^ +(Duration|DRAM Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy) ' "$out/$name.txt" | tr -s ' ' | paste -sd';')"

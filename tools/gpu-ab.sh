#!/usr/bin/env bash
# A/B measurements in one GPU call (METHOD.md: compare only what ran on the same machine, in turn).
# Builds the `fourbit` target of this tree (build-gpu/, as tools/gpu-test.sh does; reused if it is
# already built) and, with --base, of a second source tree (build-ab-base/), then runs one fourbit
# command under every variant, round after round, so that drift between machines and over time
# falls on every variant alike:
#   head                 this tree
#   base                 the --base tree (when given)
#   head VAR=value ...   this tree with each --env setting (e.g. FOURBIT_PDL=0)
#
#   tools/gpu-ab.sh [--base DIR] [--env "VAR=value[ VAR2=value]"]... [--rounds N] [--grep REGEX] \
#                   -- <fourbit arguments>
#
# Example: the decode step of this commit against a2b8810, and with PDL off:
#   git archive a2b8810 | (mkdir -p ab-base && tar -x -C ab-base)   # before the device call
#   tools/gpu-ab.sh --base ab-base --env FOURBIT_PDL=0 --grep '^step ' -- bench decode --no-gemv
# (ab-base/ is ignored by git: name it in the device tool's `carry`.)
#
# Output: each variant's lines (all of them, or those matching --grep), under a header
# "== <variant>, round <i>", on stdout and in $OUT/ab.log when OUT is set. Exit status: non-zero if
# a build failed or any run exited non-zero (every run still happens).
set -u -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
base="" rounds=2 pattern="" envs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base=$2; shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --grep) pattern=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "gpu-ab.sh: unknown option '$1' (see the comment at the top of tools/gpu-ab.sh)" >&2; exit 2 ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "gpu-ab.sh: no fourbit command after '--' (e.g. -- bench decode --no-gemv)" >&2
  exit 2
fi
case "$rounds" in
  '' | *[!0-9]*) echo "gpu-ab.sh: --rounds must be a positive integer, got '$rounds'" >&2; exit 2 ;;
esac
if [ -n "$base" ] && [ ! -f "$base/CMakeLists.txt" ]; then
  echo "gpu-ab.sh: --base '$base' is not a fourbit source tree (no CMakeLists.txt); make one with" \
       "git archive <commit> | tar -x -C '$base'" >&2
  exit 2
fi
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && log="$OUT/ab.log"
else
  log=$(mktemp) && trap 'rm -f "$log"' EXIT
fi
status=0

nvcc=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release --no-warn-unused-cli)
[ -n "$nvcc" ] && cmake_args+=(-DFOURBIT_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc")
build_fourbit() {  # source dir, build dir
  echo "gpu-ab.sh: building fourbit from $1 into $2"
  mkdir -p "$2"
  cmake -S "$1" -B "$2" "${cmake_args[@]}" >"$2/gpu-ab-configure.log" 2>&1 &&
    cmake --build "$2" --target fourbit -j "$(nproc)" >"$2/gpu-ab-build.log" 2>&1 ||
    { echo "gpu-ab.sh: build of $1 failed (logs: $2/gpu-ab-configure.log, $2/gpu-ab-build.log)"; return 1; }
}

head_bin=$root/build-gpu/src/cli/fourbit
build_fourbit "$root" "$root/build-gpu" || exit 1
variants=("head")
bins=("$head_bin")
variant_env=("")
if [ -n "$base" ]; then
  build_fourbit "$base" "$root/build-ab-base" || exit 1
  variants+=("base ($base)")
  bins+=("$root/build-ab-base/src/cli/fourbit")
  variant_env+=("")
fi
for e in "${envs[@]}"; do
  variants+=("head $e")
  bins+=("$head_bin")
  variant_env+=("$e")
done

run_all() {
  echo "gpu-ab.sh: fourbit $*; variants: ${variants[*]}; $rounds round(s); $(date -u '+%Y-%m-%d %H:%M UTC')"
  for ((r = 1; r <= rounds; ++r)); do
    for i in "${!variants[@]}"; do
      echo "== ${variants[$i]}, round $r"
      # shellcheck disable=SC2086  # the --env words are VAR=value assignments for env
      out=$(env ${variant_env[$i]} "${bins[$i]}" "$@" 2>&1)
      rc=$?
      if [ -n "$pattern" ]; then printf '%s\n' "$out" | grep -E -- "$pattern"; else printf '%s\n' "$out"; fi
      if [ $rc -ne 0 ]; then
        echo "gpu-ab.sh: exit $rc; the run's last lines:"
        printf '%s\n' "$out" | tail -n 5
        status=1
      fi
    done
  done
}
run_all "$@" >"$log" 2>&1
cat "$log"
exit $status

#!/usr/bin/env bash
# Fuzzes the safetensors reader (tests/fuzz_safetensors.cpp, a libFuzzer target) for a bounded
# time: configures a clang build folder with -DFOURBIT_FUZZ=ON (ASan + UBSan on every target),
# builds only fuzz_safetensors, and runs it on a scratch copy of the seed corpus
# tests/fuzz_corpus/safetensors/. Exit code 0 = no crash, no sanitizer report, no broken invariant;
# otherwise the crashing input is in $FOURBIT_FUZZ_DIR/artifacts/ and the exit code is non-zero.
#
#   tools/fuzz.sh [seconds]        default 60 (FOURBIT_FUZZ_SECONDS)
#   tools/fuzz.sh --merge [secs]   also add the new inputs that reach new coverage to the seed
#                                  corpus (libFuzzer -merge=1 -use_counters=0: only inputs that
#                                  reach new edges, smallest first; commit them)
#
# Environment:
#   FOURBIT_FUZZ_DIR      build folder (default: build-fuzz/ in the repository)
#   FOURBIT_FUZZ_JOBS     parallel fuzzing processes (default 1)
# Needs clang and libFuzzer (Debian/Ubuntu: apt-get install clang libclang-rt-dev; tools/deps.sh
# installs them when FOURBIT_WITH_FUZZ=1). The corpus replay test test_io_safetensors_corpus (a
# `cpu` test) runs every corpus file through the same checks without clang.
set -u -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${FOURBIT_FUZZ_DIR:-$root/build-fuzz}
corpus="$root/tests/fuzz_corpus/safetensors"
merge=0
if [ "${1:-}" = "--merge" ]; then
  merge=1
  shift
fi
seconds=${1:-${FOURBIT_FUZZ_SECONDS:-60}}
jobs=${FOURBIT_FUZZ_JOBS:-1}
t_start=$SECONDS

say() { printf 'fuzz.sh: %s\n' "$*" >&2; }

if ! command -v clang++ >/dev/null 2>&1; then
  say "clang++ not found. Install clang and libFuzzer: apt-get install clang libclang-rt-dev"
  exit 2
fi
if [ ! -d "$corpus" ]; then
  say "seed corpus $corpus is missing"
  exit 2
fi

# --- configure and build (only the fuzz target and what it links) --------------------------------
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang
            -DCMAKE_CXX_COMPILER=clang++ -DFOURBIT_FUZZ=ON -DFOURBIT_CUDA=OFF -DFOURBIT_BLAS=OFF
            --no-warn-unused-cli)
if command -v ccache >/dev/null 2>&1; then
  cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
mkdir -p "$build"
if ! cmake -S "$root" -B "$build" "${cmake_args[@]}" >"$build/configure.log" 2>&1; then
  cat "$build/configure.log" >&2
  say "FAIL: cmake configure failed (log: $build/configure.log)"
  exit 1
fi
if ! grep -q "libFuzzer targets ON" "$build/configure.log"; then
  grep -i "fuzz" "$build/configure.log" >&2
  say "FAIL: this clang has no libFuzzer (-fsanitize=fuzzer); apt-get install libclang-rt-dev"
  exit 1
fi
t_build=$SECONDS
if ! cmake --build "$build" --target fuzz_safetensors -j "$(nproc)"; then
  say "FAIL: building fuzz_safetensors failed"
  exit 1
fi
build_s=$((SECONDS - t_build))

# --- fuzz ----------------------------------------------------------------------------------------
# libFuzzer writes the inputs it finds into the FIRST corpus directory: a scratch one, so that the
# seed corpus only changes through --merge.
work="$build/fuzz-work"
artifacts="$build/artifacts"
rm -rf "$work"
mkdir -p "$work" "$artifacts"
t_fuzz=$SECONDS
say "fuzzing for ${seconds}s ($jobs job(s)); seeds: $(find "$corpus" -type f | wc -l) files"
fuzz_args=(-max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048
           -artifact_prefix="$artifacts/" -print_final_stats=1)
if [ "$jobs" -gt 1 ]; then
  fuzz_args+=(-jobs="$jobs" -workers="$jobs")
fi
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
  "$build/tests/fuzz_safetensors" "${fuzz_args[@]}" "$work" "$corpus" 2>"$build/fuzz.log"
rc=$?
fuzz_s=$((SECONDS - t_fuzz))
grep -E "^(#[0-9]+ +DONE|stat::|Done [0-9]+ runs)" "$build/fuzz.log" >&2 || true
new=$(find "$work" -type f | wc -l)

if [ "$rc" -ne 0 ]; then
  tail -n 60 "$build/fuzz.log" >&2
  say "FAIL: the fuzzer found a bug (exit $rc); inputs: $(ls "$artifacts" | tr '\n' ' ')"
  say "reproduce: $build/tests/fuzz_safetensors $artifacts/<file>; add the input to $corpus once fixed"
  exit "$rc"
fi

if [ "$merge" -eq 1 ] && [ "$new" -gt 0 ]; then
  before=$(find "$corpus" -type f | wc -l)
  "$build/tests/fuzz_safetensors" -merge=1 -use_counters=0 "$corpus" "$work" 2>"$build/merge.log" ||
    { tail -n 20 "$build/merge.log" >&2; say "FAIL: merge"; exit 1; }
  after=$(find "$corpus" -type f | wc -l)
  say "merged $((after - before)) new inputs with new coverage into $corpus (git add them)"
fi
say "PASS: no crash in ${fuzz_s}s of fuzzing ($new new inputs found; build ${build_s}s," \
    "total $((SECONDS - t_start))s)"

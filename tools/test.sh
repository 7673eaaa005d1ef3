#!/usr/bin/env bash
# The test command: installs what the build lacks (tools/deps.sh), configures and builds fourbit
# (Ninja, Release) and runs the CPU test suite (`ctest -L cpu`), then, where clang with libFuzzer is
# installed, a bounded fuzz run of the safetensors reader (tools/fuzz.sh, FOURBIT_FUZZ_SECONDS,
# default 30, 0 skips), and, where the build has CUDA, a compile of the CPU-only configuration
# (FOURBIT_CPU_ONLY_CHECK=0 skips it). The exit code is ctest's, or 1 if only the fuzz run or the
# CPU-only compile failed; the last line is a one-line summary. This is what CI runs (.ci/run).
#
#   tools/test.sh [extra ctest arguments, e.g. -R quant]
#
# Environment:
#   FOURBIT_BUILD_DIR   build folder (default: build/ in the repository)
#   FOURBIT_CMAKE_ARGS  extra cmake arguments, e.g. "-DFOURBIT_CUDA=OFF" (CMake keeps them in the
#                       build folder's cache, so later runs without them keep the setting)
# The CUDA kernels are compiled when nvcc is found (on PATH or in /usr/local/cuda/bin); the tests
# labelled `gpu` need a GPU and are run by tools/gpu-test.sh, not here.
set -u -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${FOURBIT_BUILD_DIR:-$root/build}
jobs=$(nproc)
t_start=$SECONDS

summary() { printf 'tools/test.sh: %s (%ds total)\n' "$*" $((SECONDS - t_start)); }

"$root/tools/deps.sh" || { summary "FAIL: build dependencies missing (see above)"; exit 1; }

# --- configure and build ---------------------------------------------------------------------------
# shellcheck source=tools/configure.sh
. "$root/tools/configure.sh"
if ! fourbit_configure; then
  summary "FAIL: cmake configure failed (log: $build/configure.log)"
  exit 1
fi
cuda=$(sed -n 's/^FOURBIT_CUDA:BOOL=//p' "$build/CMakeCache.txt")
echo "tools/test.sh: building in $build (CUDA ${cuda:-?}, $jobs jobs)"
t_build=$SECONDS
if ! cmake --build "$build" -j "$jobs"; then
  summary "FAIL: build failed (CUDA ${cuda:-?}; see the compiler output above)"
  exit 1
fi
build_s=$((SECONDS - t_build))

# --- CPU tests -----------------------------------------------------------------------------------
t_test=$SECONDS
(cd "$build" && ctest -L cpu --output-on-failure --no-tests=error -j "$jobs" "$@") |
  tee "$build/test-cpu.log"
rc=${PIPESTATUS[0]}
test_s=$((SECONDS - t_test))

# --- bounded fuzzing of the safetensors reader (tools/fuzz.sh; skipped without clang/libFuzzer) ---
# FOURBIT_FUZZ_SECONDS (default 30; 0 skips) of libFuzzer in a separate clang ASan+UBSan build.
fuzz_note=""
fuzz_seconds=${FOURBIT_FUZZ_SECONDS:-30}
have_libfuzzer() {
  command -v clang++ >/dev/null 2>&1 &&
    printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' |
      clang++ -fsanitize=fuzzer -x c++ -o /dev/null - >/dev/null 2>&1
}
if [ "$fuzz_seconds" != 0 ] && have_libfuzzer; then
  t_fuzz=$SECONDS
  if "$root/tools/fuzz.sh" "$fuzz_seconds"; then
    fuzz_note="; fuzz ${fuzz_seconds}s: no crash ($((SECONDS - t_fuzz))s)"
  else
    fuzz_note="; fuzz: FAILED (tools/fuzz.sh, see above)"
    [ "$rc" -eq 0 ] && rc=1
  fi
elif [ "$fuzz_seconds" != 0 ]; then
  fuzz_note="; fuzz: skipped (no clang with libFuzzer; apt-get install clang libclang-rt-dev)"
fi

# --- the CPU-only configuration compiles too -------------------------------------------------------
# Where this build has CUDA, the configuration a machine without nvcc gets (-DFOURBIT_CUDA=OFF) is
# compiled as well: the libraries and the CLI, not the tests, in ${build}-cpu-only. CUDA-only code
# outside `#if defined(FOURBIT_WITH_CUDA)` otherwise breaks that build unseen (session 14 did).
# FOURBIT_CPU_ONLY_CHECK=0 skips it.
cpu_only_note=""
if [ "${cuda:-}" = "ON" ] && [ "${FOURBIT_CPU_ONLY_CHECK:-1}" != 0 ]; then
  t_cpu_only=$SECONDS
  if (build="${build}-cpu-only" FOURBIT_CMAKE_ARGS="${FOURBIT_CMAKE_ARGS:-} -DFOURBIT_CUDA=OFF" &&
      fourbit_configure && cmake --build "$build" -j "$jobs" --target fourbit); then
    cpu_only_note="; CPU-only build of the CLI ok ($((SECONDS - t_cpu_only))s)"
  else
    cpu_only_note="; CPU-only build (-DFOURBIT_CUDA=OFF) FAILED (see above)"
    [ "$rc" -eq 0 ] && rc=1
  fi
fi

counts=$(grep -E '^[0-9]+% tests passed' "$build/test-cpu.log" | tail -n 1)
if [ "$rc" -eq 0 ]; then
  summary "PASS: ${counts:-ctest passed} [cpu label, CUDA ${cuda:-?}; build ${build_s}s, tests ${test_s}s${fuzz_note}${cpu_only_note}]"
else
  summary "FAIL (exit $rc): ${counts:-see the output above} [cpu label, CUDA ${cuda:-?};" \
          "build ${build_s}s, tests ${test_s}s${fuzz_note}${cpu_only_note}]"
fi
exit "$rc"

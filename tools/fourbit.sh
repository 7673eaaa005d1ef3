#!/usr/bin/env bash
# The main command: installs what the build lacks (tools/deps.sh), builds fourbit if needed, then
# runs `fourbit run` (the main job on its built-in default) with any arguments given here:
#
#   tools/fourbit.sh                 # the default job
#   tools/fourbit.sh --help          # its options
#
# Build messages go to stderr, so stdout holds only fourbit's own output.
# Environment: FOURBIT_BUILD_DIR, FOURBIT_CMAKE_ARGS, as for tools/test.sh.
set -u -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${FOURBIT_BUILD_DIR:-$root/build}

"$root/tools/deps.sh" >&2 || exit 1

# --- configure and build (tools/test.sh does the same; keep the two in step) --------------------
if [ -x "$root/build-venv/bin/python3" ]; then  # made by tools/deps.sh under PEP 668
  export VIRTUAL_ENV="$root/build-venv" PATH="$root/build-venv/bin:$PATH"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release --no-warn-unused-cli)
if command -v ccache >/dev/null 2>&1; then
  cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
read -r -a extra_args <<<"${FOURBIT_CMAKE_ARGS:-}"
mkdir -p "$build"
if ! cmake -S "$root" -B "$build" "${cmake_args[@]}" ${extra_args[@]+"${extra_args[@]}"} \
     >"$build/configure.log" 2>&1; then
  cat "$build/configure.log" >&2
  echo "tools/fourbit.sh: cmake configure failed (log: $build/configure.log)" >&2
  exit 1
fi
if ! cmake --build "$build" --target fourbit -j "$(nproc)" >&2; then
  echo "tools/fourbit.sh: build failed; see the compiler output above" >&2
  exit 1
fi

exec "$build/src/cli/fourbit" run "$@"

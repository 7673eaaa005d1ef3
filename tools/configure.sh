# shellcheck shell=bash disable=SC2154  # root and build are set by the sourcing script
# Sourced by tools/test.sh and tools/fourbit.sh: puts the tools the build needs on PATH and
# configures the build folder $build for the source tree $root (Ninja, Release, ccache when
# present, plus $FOURBIT_CMAKE_ARGS). Defines `fourbit_configure`, which returns non-zero and
# prints the configure log to stderr when cmake fails.
if [ -x "$root/build-venv/bin/python3" ]; then  # made by tools/deps.sh under PEP 668
  export VIRTUAL_ENV="$root/build-venv" PATH="$root/build-venv/bin:$PATH"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi

fourbit_configure() {
  local cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release --no-warn-unused-cli)
  if command -v ccache >/dev/null 2>&1; then
    cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  local extra_args
  read -r -a extra_args <<<"${FOURBIT_CMAKE_ARGS:-}"
  mkdir -p "$build"
  if ! cmake -S "$root" -B "$build" "${cmake_args[@]}" ${extra_args[@]+"${extra_args[@]}"} \
       >"$build/configure.log" 2>&1; then
    cat "$build/configure.log" >&2
    return 1
  fi
}

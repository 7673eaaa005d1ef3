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

# shellcheck source=tools/configure.sh
. "$root/tools/configure.sh"
if ! fourbit_configure; then
  echo "tools/fourbit.sh: cmake configure failed (log: $build/configure.log)" >&2
  exit 1
fi
if ! cmake --build "$build" --target fourbit -j "$(nproc)" >&2; then
  echo "tools/fourbit.sh: build failed; see the compiler output above" >&2
  exit 1
fi

exec "$build/src/cli/fourbit" run "$@"

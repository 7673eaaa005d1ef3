#!/usr/bin/env bash
# Checks that this machine has what fourbit needs to build and test, and installs what is missing
# (Debian/Ubuntu). Silent and quick when everything is present; safe to run any number of times.
#
#   C++ build: cmake >= 3.25, ninja, g++ >= 10 (C++20), fmt, CLI11, nlohmann-json, googletest,
#              OpenBLAS (the CPU GEMM backend; configure with -DFOURBIT_BLAS=OFF to build without it)
#   tests:     python3 with numpy and ml_dtypes (an independent reference for the element codecs)
#   optional:  ccache (used when present), nvcc (CUDA kernels are built when it is found; this
#              script never installs CUDA), clang + libclang-rt-dev (libFuzzer, for the bounded
#              fuzz run of tools/test.sh; installed when apt-get needs no password)
#
# Missing Debian packages are installed with apt-get when we are root or have non-interactive
# sudo; otherwise the exact command to run is printed and the script exits non-zero. Missing Python
# modules are installed with pip into the python3 on PATH; where that Python is "externally
# managed" (PEP 668, e.g. Debian's /usr/bin/python3) they go into a virtual environment at
# build-venv/ instead, which tools/test.sh and tools/fourbit.sh put on PATH.
set -u -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/build-venv"
py_modules=(numpy ml_dtypes)

say() { printf 'deps.sh: %s\n' "$*" >&2; }

# --- what is missing -----------------------------------------------------------------------------
apt_missing=()
problems=()

need_cmd() {  # need_cmd <command> <debian package>
  command -v "$1" >/dev/null 2>&1 || apt_missing+=("$2")
}
need_cmd cmake cmake
need_cmd ninja ninja-build
need_cmd g++ g++
need_cmd git git
need_cmd python3 python3

if command -v cmake >/dev/null 2>&1; then
  cmake_version=$(cmake --version | sed -n '1s/[^0-9]*\([0-9][0-9.]*\).*/\1/p')
  if ! printf '3.25\n%s\n' "$cmake_version" | sort -V -C; then
    problems+=("cmake $cmake_version is older than 3.25; install a newer one, e.g." \
               "  python3 -m pip install 'cmake>=3.25'   (or Kitware's apt repository)")
  fi
fi

have_header() {  # have_header <header>: can g++ find it in C++20 mode?
  printf '#include <%s>\n' "$1" | g++ -std=c++20 -x c++ -E -o /dev/null - >/dev/null 2>&1
}
if command -v g++ >/dev/null 2>&1; then
  gxx_major=$(g++ -dumpversion | cut -d. -f1)
  if [ "${gxx_major:-0}" -lt 10 ]; then
    problems+=("g++ $(g++ -dumpversion) is too old for C++20; fourbit needs g++ >= 10")
  fi
  # One g++ call for the common case (all there), one per header to name what is missing.
  if ! printf '#include <%s>\n' fmt/format.h CLI/CLI.hpp nlohmann/json.hpp gtest/gtest.h |
       g++ -std=c++20 -x c++ -E -o /dev/null - >/dev/null 2>&1; then
    have_header fmt/format.h || apt_missing+=(libfmt-dev)
    have_header CLI/CLI.hpp || apt_missing+=(libcli11-dev)
    have_header nlohmann/json.hpp || apt_missing+=(nlohmann-json3-dev)
    have_header gtest/gtest.h || apt_missing+=(libgtest-dev)
  fi
  have_openblas() {  # the library (Debian installs it under an alternatives link) and a cblas.h
    local f lib=0
    [ "$(g++ -print-file-name=libopenblas.so)" != libopenblas.so ] && lib=1
    for f in /usr/lib/*/openblas*/libopenblas.so; do [ -e "$f" ] && lib=1; done
    [ "$lib" -eq 1 ] || return 1
    for f in /usr/include/*/openblas*/cblas.h /usr/include/openblas/cblas.h /usr/include/*/cblas.h \
             /usr/include/cblas.h; do
      [ -e "$f" ] && return 0
    done
    return 1
  }
  have_openblas || apt_missing+=(libopenblas-dev)
  have_gtest_lib() {  # -print-file-name echoes the bare name when the library is not found
    [ "$(g++ -print-file-name=libgtest.a)" != libgtest.a ] ||
      [ "$(g++ -print-file-name=libgtest.so)" != libgtest.so ]
  }
  have_gtest_lib || apt_missing+=(libgtest-dev)
else
  # No compiler yet: a fresh machine. apt-get skips whatever is already installed.
  apt_missing+=(libfmt-dev libcli11-dev nlohmann-json3-dev libgtest-dev libopenblas-dev)
fi

py_has_modules() {  # py_has_modules <python>
  local IFS=,
  "$1" -c "import ${py_modules[*]}" >/dev/null 2>&1
}
py_externally_managed() {
  python3 - >/dev/null 2>&1 <<'EOF'
import os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)
EOF
}

need_py_install=0
if command -v python3 >/dev/null 2>&1 && py_has_modules python3; then
  :
elif [ -x "$venv/bin/python3" ] && py_has_modules "$venv/bin/python3"; then
  :
else
  need_py_install=1
  if command -v python3 >/dev/null 2>&1; then
    if py_externally_managed; then
      python3 -c 'import ensurepip' >/dev/null 2>&1 || apt_missing+=(python3-venv)
    else
      python3 -m pip --version >/dev/null 2>&1 || apt_missing+=(python3-pip)
    fi
  else
    apt_missing+=(python3-pip python3-venv)  # with python3, added above
  fi
fi

if [ ${#problems[@]} -gt 0 ]; then
  for p in "${problems[@]}"; do say "$p"; done
  exit 1
fi

# --- apt packages --------------------------------------------------------------------------------
if [ ${#apt_missing[@]} -gt 0 ]; then
  mapfile -t apt_missing < <(printf '%s\n' "${apt_missing[@]}" | sort -u)
  apt_cmd="apt-get update && apt-get install -y --no-install-recommends ${apt_missing[*]}"
  if ! command -v apt-get >/dev/null 2>&1; then
    say "missing: ${apt_missing[*]} (Debian package names); this is not a Debian/Ubuntu system," \
        "install the equivalents with your package manager, then run this again"
    exit 1
  fi
  if [ "$(id -u)" -eq 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
    sudo=(sudo -n)
  else
    say "missing: ${apt_missing[*]}"
    say "run this, then run the command again:"
    printf '  sudo apt-get update && sudo apt-get install -y --no-install-recommends %s\n' \
      "${apt_missing[*]}" >&2
    exit 1
  fi
  say "installing ${apt_missing[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  if ! { "${sudo[@]}" apt-get update -qq &&
         "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${apt_missing[@]}"; } >&2; then
    say "apt-get failed; the command was: $apt_cmd"
    exit 1
  fi
fi

# --- optional: clang and libFuzzer for tools/fuzz.sh (tools/test.sh runs it when present) ---------
# Installed only where apt-get needs no password (root, CI); elsewhere a note, never a failure.
# FOURBIT_WITH_FUZZ=0 skips this.
if [ "${FOURBIT_WITH_FUZZ:-1}" != 0 ] && command -v apt-get >/dev/null 2>&1 &&
   ! { command -v clang++ >/dev/null 2>&1 &&
       printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' |
         clang++ -fsanitize=fuzzer -x c++ -o /dev/null - >/dev/null 2>&1; }; then
  fuzz_sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then fuzz_sudo=(sudo -n); else fuzz_sudo=(none); fi
  fi
  if [ "${fuzz_sudo[0]:-}" = none ]; then
    say "note: clang with libFuzzer is missing, so tools/test.sh skips the safetensors fuzz run" \
        "(sudo apt-get install clang libclang-rt-dev to enable it)"
  else
    say "installing clang libclang-rt-dev (the safetensors fuzz run of tools/test.sh) with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    { "${fuzz_sudo[@]}" apt-get update -qq &&
      "${fuzz_sudo[@]}" apt-get install -y -qq --no-install-recommends clang libclang-rt-dev; } >&2 ||
      say "note: could not install clang libclang-rt-dev; tools/test.sh skips the fuzz run"
  fi
fi

# --- Python modules ------------------------------------------------------------------------------
if [ "$need_py_install" -eq 1 ] && ! py_has_modules python3; then
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
  pip_log=$(mktemp)
  trap 'rm -f "$pip_log"' EXIT
  if ! py_externally_managed && python3 -m pip install -q "${py_modules[@]}" >"$pip_log" 2>&1; then
    say "installed ${py_modules[*]} with: python3 -m pip install ${py_modules[*]}"
  elif rm -rf "$venv" && python3 -m venv "$venv" >"$pip_log" 2>&1 &&
       "$venv/bin/python3" -m pip install -q "${py_modules[@]}" >>"$pip_log" 2>&1; then
    say "python3 ($(command -v python3)) is externally managed (PEP 668) or pip failed there;" \
        "installed ${py_modules[*]} into the virtual environment $venv" \
        "(tools/test.sh and tools/fourbit.sh use it; run 'source build-venv/bin/activate'" \
        "before running ctest by hand)"
  else
    rm -rf "$venv"
    user=()
    [ "$(id -u)" -eq 0 ] || user=(--user)
    if python3 -m pip install -q "${user[@]}" --break-system-packages "${py_modules[@]}" \
         >>"$pip_log" 2>&1; then
      say "no virtual environment possible; installed ${py_modules[*]} with:" \
          "python3 -m pip install ${user[*]} --break-system-packages ${py_modules[*]}"
    else
      cat "$pip_log" >&2
      say "could not install the Python modules ${py_modules[*]}; install them for" \
          "$(command -v python3), e.g.: python3 -m pip install ${py_modules[*]}"
      exit 1
    fi
  fi
fi
exit 0

#!/usr/bin/env bash
# CI, optional: what the gfx942 checks need beyond the main install (tests/test_hip_codegen.py).
# - TileLang 0.1.11 (SGLang's pin) in a side directory: its PyPI wheel has HIP codegen, 0.1.9's (vLLM's
#   pin, the main install) does not. --no-deps: its other requirements are already installed.
# - Debian bookworm's clang-19, lld-19 (the amdgcn linker) and llvm-19 (llvm-readelf), installed with apt (root).
# - ROCm >= 6 pieces from Debian's archive, unpacked into .ci/rocm-root (nothing installed system-wide, no
#   suite added to the system's apt sources): the HIP 6.4 headers (libamdhip64-dev, unstable; bookworm's are
#   HIP 5.2, older than TileLang's HIP templates) and the device libraries as LLVM 17 bitcode
#   (rocm-device-libs-17, trixie; unstable's rocm-device-libs-21 is LLVM 21 bitcode, which clang-19 cannot
#   read). .ci/rocm-root/PACKAGES lists what was unpacked.
# Any step that fails prints why; the test then skips with the reason.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install -q --no-deps --target .ci/tilelang-hip tilelang==0.1.11 apache-tvm-ffi==0.1.11 \
  torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0 || echo "tilelang 0.1.11 side install failed: HIP codegen test will skip"

command -v apt-get >/dev/null || { echo "no apt-get: the gfx942 code-object test will skip"; exit 0; }

if [ "$(id -u)" = 0 ]; then
  LLVM_PKGS="clang-19 lld-19 llvm-19"
  # shellcheck disable=SC2086
  (apt-get install -y -q --no-install-recommends $LLVM_PKGS >/dev/null 2>&1 ||
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends $LLVM_PKGS >/dev/null 2>&1)) ||
    echo "clang-19 / lld-19 / llvm-19 not installed: the gfx942 code-object test will skip"
fi

# Debian packages from another suite, downloaded with a private apt configuration (own sources, lists and cache
# under a temporary directory) and unpacked with dpkg -x.
MIRROR="${MLA_BACKEND_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
ROOT_DIR=.ci/rocm-root
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

fetch_suite() {  # fetch_suite SUITE PACKAGE...: download the packages of SUITE into $WORK/debs
  local suite=$1; shift
  local d="$WORK/apt-$suite"
  mkdir -p "$d/lists/partial" "$d/cache/archives/partial" "$WORK/debs"
  echo "deb [signed-by=$KEYRING] $MIRROR $suite main" >"$d/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$d/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$d/lists" -o "Dir::Cache=$d/cache" -o Debug::NoLocking=1
              -o APT::Sandbox::User=root)
  apt-get -q "${opts[@]}" update >"$WORK/update-$suite.log" 2>&1 || { tail -3 "$WORK/update-$suite.log"; return 1; }
  (cd "$WORK/debs" && apt-get -q "${opts[@]}" download "$@" >"$WORK/download-$suite.log" 2>&1) ||
    { tail -3 "$WORK/download-$suite.log"; return 1; }
  for p in "$@"; do
    echo "$p $(apt-cache "${opts[@]}" show --no-all-versions "$p" 2>/dev/null | sed -n 's/^Version: //p') $suite" \
      >>"$WORK/PACKAGES"
  done
}

if fetch_suite unstable libamdhip64-dev && fetch_suite trixie rocm-device-libs-17; then
  rm -rf "$ROOT_DIR" && mkdir -p "$ROOT_DIR"
  for deb in "$WORK"/debs/*.deb; do dpkg -x "$deb" "$ROOT_DIR" || { echo "dpkg -x $deb failed"; rm -rf "$ROOT_DIR"; }; done
  [ -d "$ROOT_DIR" ] && cp "$WORK/PACKAGES" "$ROOT_DIR/PACKAGES" && sed 's/^/rocm-root: /' "$ROOT_DIR/PACKAGES"
else
  echo "ROCm headers / device libraries not downloaded: the gfx942 code-object test will skip"
fi
exit 0

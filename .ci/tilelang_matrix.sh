#!/usr/bin/env bash
# CI: the kernels lowered for sm_90a (and two split variants nvcc-compiled) under each TileLang release an install
# of this project can resolve to, by tests/test_tilelang_versions.py:
#   0.1.9   the main install (.ci/constraints.txt; vLLM 0.26's pin)          required
#   0.1.11  SGLang 0.5.17's pin                                              required
#   0.1.12  vLLM 0.27 .. 0.33's and SGLang 0.5.23's pin                      required
#   0.1.15  the newest release, what a fresh install resolves               required
# pyproject admits exactly these (>=0.1.9,!=0.1.10,!=0.1.13,!=0.1.14,<0.1.16): a release joins the range once it passes
# here and tests/test_lowering_ws.py under it, and joins MLA_BACKEND_TILELANG_MATRIX's default. A version named in
# MLA_BACKEND_TILELANG_PENDING is run and reported but does not fail CI.
# Each side version goes into .ci/tilelang-<version> with the apache-tvm-ffi a fresh install of this project resolves
# beside it (pyproject: apache-tvm-ffi>=0.1.10,<0.1.12, so 0.1.11 for all three), put first on PYTHONPATH for one
# pytest run. --no-deps: torch, numpy, ... come from the main install; z3-solver and torch-c-dlpack-ext go into the
# side directory too, as in install_hip_toolchain.sh (0.1.11 looks for libz3 beside itself).
#   bash .ci/tilelang_matrix.sh install   # side directories only (~30-60 s and ~300 MB each)
#   bash .ci/tilelang_matrix.sh test      # one pytest run per version, then a table; exit 1 if a required one failed
#   bash .ci/tilelang_matrix.sh           # both
# MLA_BACKEND_TILELANG_MATRIX (required side versions, default "0.1.11 0.1.12 0.1.15"), MLA_BACKEND_TILELANG_PENDING
# (default none), MLA_BACKEND_TILELANG_MAIN=0 (skip the main install's run, e.g. when the README command just ran
# the file under it).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
what="${1:-all}"

# version -> apache-tvm-ffi: what pip resolves for tilelang 0.1.11 (asks >=0.1.10,~=0.1.0), 0.1.12 (>=0.1.10,<=0.1.11)
# and 0.1.15 (>=0.1.11,<0.1.13) under pyproject's apache-tvm-ffi<0.1.12. 0.1.11 aborts at import with 0.1.12 and newer.
declare -A TVM_FFI=([0.1.11]=0.1.11 [0.1.12]=0.1.11 [0.1.15]=0.1.11)
SIDE_VERSIONS="${MLA_BACKEND_TILELANG_MATRIX-0.1.11 0.1.12 0.1.15}"
PENDING_VERSIONS="${MLA_BACKEND_TILELANG_PENDING-}"

install_side() {  # install_side VERSION: .ci/tilelang-VERSION, unless it already holds that version
  local v=$1 dir=".ci/tilelang-$1"
  if [ -d "$dir/tilelang-$v.dist-info" ] && [ -d "$dir/apache_tvm_ffi-${TVM_FFI[$v]}.dist-info" ] &&
     [ -d "$dir/z3_solver-4.15.4.0.dist-info" ]; then
    return 0
  fi
  rm -rf "$dir"
  "$PYTHON" -m pip install -q --no-deps --target "$dir" "tilelang==$v" "apache-tvm-ffi==${TVM_FFI[$v]}" \
    torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0 ||
    { echo "tilelang $v side install failed"; rm -rf "$dir"; return 1; }
}

declare -A RESULT
run_version() {  # run_version VERSION [SIDE_DIR]
  local v=$1 dir=${2:-} log rc start=$SECONDS
  log="$(mktemp)"
  echo "=== TileLang $v: tests/test_tilelang_versions.py${dir:+ (PYTHONPATH=$dir)}"
  if [ -n "$dir" ]; then
    PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" MLA_BACKEND_EXPECT_TILELANG="$v" \
      "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider -m "" tests/test_tilelang_versions.py 2>&1 | tee "$log"
  else
    MLA_BACKEND_EXPECT_TILELANG="$v" \
      "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider -m "" tests/test_tilelang_versions.py 2>&1 | tee "$log"
  fi
  rc=${PIPESTATUS[0]}
  RESULT[$v]="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|no tests ran' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
  RESULT[$v]="${RESULT[$v]:-no summary} (rc $rc, $((SECONDS - start)) s)"
  rm -f "$log"
  return "$rc"
}

if [ "$what" = all ] || [ "$what" = install ]; then
  for v in $SIDE_VERSIONS $PENDING_VERSIONS; do install_side "$v"; done
fi
[ "$what" = install ] && exit 0

failed=0
main_version="$("$PYTHON" -c 'import tilelang; print(tilelang.__version__.split("+")[0])' 2>/dev/null || echo none)"
rows=()
if [ "${MLA_BACKEND_TILELANG_MAIN:-1}" != 0 ]; then
  run_version "$main_version" || failed=1
  rows+=("$main_version:main install")
else
  RESULT[$main_version]="not run here (MLA_BACKEND_TILELANG_MAIN=0: .ci/run's README command and -m slow passes ran it)"
  rows+=("$main_version:main install")
fi
for v in $SIDE_VERSIONS $PENDING_VERSIONS; do
  kind=required
  case " $PENDING_VERSIONS " in *" $v "*) kind=pending ;; esac
  if [ -d ".ci/tilelang-$v/tilelang-$v.dist-info" ]; then
    run_version "$v" ".ci/tilelang-$v" || { [ "$kind" = required ] && failed=1; }
  else
    RESULT[$v]="not installed (.ci/tilelang-$v missing)"
    [ "$kind" = required ] && failed=1
  fi
  rows+=("$v:$kind")
done

echo "=== TileLang matrix (tests/test_tilelang_versions.py: sm_90a lowering, nvcc -c of two split variants)"
for row in "${rows[@]}"; do
  printf '  tilelang %-7s %-13s -> %s\n' "${row%%:*}" "(${row#*:})" "${RESULT[${row%%:*}]}"
done
exit "$failed"

"""gfx942 (MI300X): HIP C++ from TileLang, then a compile attempt with Debian's clang-19 (CPU only).

TileLang 0.1.9 (vLLM's pin, the main install) has no HIP codegen in its PyPI wheel; 0.1.11 (SGLang's pin)
does. ``.ci/install_hip_toolchain.sh`` puts 0.1.11 in ``.ci/tilelang-hip`` (or point
``MLA_BACKEND_HIP_TILELANG`` at such a directory); the generation runs in a subprocess with that TileLang
first on the path. Without it, these tests skip and say so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIDE = Path(os.environ.get("MLA_BACKEND_HIP_TILELANG", ROOT / ".ci" / "tilelang-hip"))
# (num_heads, q_len, page_size): TP8 decode at page 64, and TP1 MTP at SGLang's page size 1
VARIANTS = [(16, 1, 64), (128, 2, 1)]
# ROCm >= 5.7 headers TileLang's HIP templates include; Debian bookworm ships HIP 5.2.
KNOWN_MISSING_HEADERS = ("hip/hip_bf16.h", "hip/amd_detail/amd_hip_fp8.h", "rocwmma/rocwmma.hpp")

GENERATE = r"""
import json, sys
import tilelang
from tilelang import tvm
from tvm.target import Target
from mla_backend.kernels import configs
from mla_backend.kernels.mla_decode import build_combine_kernel, build_decode_kernel

out_dir, variants = sys.argv[1], json.loads(sys.argv[2])
target = Target(configs.target_for_arch("gfx942"))
report = {"tilelang": tilelang.__version__}
funcs = {f"split-{h}-{q}-{p}": build_decode_kernel(h, q, p, "bfloat16", "bfloat16", configs.GFX942)
         for h, q, p in variants}
funcs["combine"] = build_combine_kernel(16, 1, "bfloat16")
funcs["combine-wide"] = build_combine_kernel(16, 1, "bfloat16", wide=True)
for name, func in funcs.items():
    with tvm.transform.PassContext(config=configs.compat_pass_configs()), target:
        src = tilelang.lower(func, target=target, enable_device_compile=False).kernel_source
    with open(f"{out_dir}/{name}.hip", "w") as f:
        f.write(src)
    report[name] = {"bytes": len(src), "mfma": src.count("__builtin_amdgcn_mfma")}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def hip_sources(tmp_path_factory):
    if not (SIDE / "tilelang").is_dir():
        pytest.skip(f"no TileLang with HIP codegen at {SIDE} (.ci/install_hip_toolchain.sh installs 0.1.11 there)")
    out = tmp_path_factory.mktemp("hip")
    # Importing TileLang 0.1.9 here (test collection does) exports its own library / tvm paths: drop them so
    # the subprocess loads 0.1.11 whole.
    inherited = ("PYTHONPATH", "TVM_LIBRARY_PATH", "TL_CUTLASS_PATH", "TL_COMPOSABLE_KERNEL_PATH", "TL_TEMPLATE_PATH")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env["PYTHONPATH"] = os.pathsep.join([str(SIDE), str(ROOT)])
    proc = subprocess.run([sys.executable, "-c", GENERATE, str(out), json.dumps(VARIANTS)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def test_hip_source_uses_mfma(hip_sources):
    _, report = hip_sources
    assert report["tilelang"].startswith("0.1.1"), report  # the side install, not the main 0.1.9
    for h, q, p in VARIANTS:
        entry = report[f"split-{h}-{q}-{p}"]
        assert entry["mfma"] > 0, f"split kernel h={h} q_len={q} page={p}: no MFMA builtin in the HIP source"
    assert report["combine"]["bytes"] > 0 and report["combine-wide"]["bytes"] > 0


def _clang() -> str | None:
    return shutil.which("clang-19") or next(
        (c for c in ("/usr/lib/llvm-19/bin/clang++",) if os.path.exists(c)), None)


def test_hip_compiles_for_gfx942_with_debian_clang(hip_sources, tmp_path):
    """Compile with what Debian bookworm offers. Its HIP 5.2 headers predate what TileLang's HIP
    templates include (docs/amd.md): that known gap is an expected failure, any other error fails."""
    clang = _clang()
    if clang is None or not os.path.exists("/usr/include/hip/hip_runtime.h"):
        pytest.skip("clang-19 and Debian's HIP headers (libamdhip64-dev) are not installed")
    out, _ = hip_sources
    tl_src = SIDE / "tilelang" / "src"
    ck = SIDE / "tilelang" / "3rdparty" / "composable_kernel" / "include"
    h, q, p = VARIANTS[0]
    cmd = [clang, "-x", "hip", "--offload-arch=gfx942", "--offload-device-only", "-nogpulib", "-O3", "-std=c++17",
           "-c", f"-I{tl_src}", f"-I{ck}", str(out / f"split-{h}-{q}-{p}.hip"), "-o", str(tmp_path / "split.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        assert (tmp_path / "split.o").stat().st_size > 0
        return
    fatal = [line for line in proc.stderr.splitlines() if "fatal error:" in line]
    if fatal and any(f"'{header}' file not found" in fatal[0] for header in KNOWN_MISSING_HEADERS):
        pytest.xfail(f"Debian's HIP 5.2 is too old for TileLang's HIP templates: {fatal[0].split(': ', 1)[-1]}")
    pytest.fail(f"{' '.join(cmd)}\n{proc.stderr[-4000:]}")

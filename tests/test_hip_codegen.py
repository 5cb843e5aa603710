"""gfx942 (MI300X): HIP C++ from TileLang, then gfx942 code objects (HSACO) and their resources (CPU only), for
16-bit and float8_e4m3fnuz caches.

TileLang 0.1.9 (vLLM's pin, the main install) has no HIP codegen in its PyPI wheel; 0.1.11 (SGLang's pin)
does. ``.ci/install_hip_toolchain.sh`` puts 0.1.11 in ``.ci/tilelang-hip`` (or point
``MLA_BACKEND_HIP_TILELANG`` at such a directory); the generation runs in subprocesses with that TileLang
first on the path. The same script installs Debian bookworm's clang-19 / lld-19 / llvm-19 and unpacks ROCm >= 6
headers and device libraries from Debian's archive into ``.ci/rocm-root`` (or ``MLA_BACKEND_ROCM_ROOT``): each
kernel is compiled for gfx942 as TileLang's runtime does (``-O3 -std=c++17``, its templates and composable_kernel),
and the code object's metadata (``llvm-readelf --notes``) gives its VGPRs, SGPRs, LDS and scratch. Without
these, the tests skip and say so. docs/amd.md turns the numbers into occupancy.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIDE = Path(os.environ.get("MLA_BACKEND_HIP_TILELANG", ROOT / ".ci" / "tilelang-hip"))
ROCM_ROOT = Path(os.environ.get("MLA_BACKEND_ROCM_ROOT", ROOT / ".ci" / "rocm-root"))
# Lowering one split kernel takes ~20-40 s of CPU: the variants are shared among this many worker processes.
JOBS = max(1, int(os.environ.get("MLA_BACKEND_HIP_JOBS", "2")))
DTYPES = ("bfloat16", "float16")
FP8 = "float8_e4m3fnuz"  # the fp8 cache the gfx942 kernel takes (MI300X's e4m3; dispatch.FP8_KV_DTYPES)
# (q dtype, cache dtype, num_heads, q_len, page_size): TP8 (16 heads) and TP1 (128), decode and one MTP token,
# SGLang's page 1, 16, 64; 16-bit caches in both dtypes, the fp8 cache with bf16 q (DeepSeek's) and, at two corners,
# fp16 q (the same kernel but for the 16-bit type the cache is converted to)
SHAPES = [(h, q, p) for h in (16, 128) for q in (1, 2) for p in (1, 16, 64)]
SPLITS = ([(d, d, *shape) for d in DTYPES for shape in SHAPES] + [("bfloat16", FP8, *shape) for shape in SHAPES]
          + [("float16", FP8, 16, 1, 64), ("float16", FP8, 128, 2, 1)])
COMBINES = [(d, h, q, wide) for d in DTYPES for h in (16, 128) for q in (1, 2) for wide in (False, True)]
# MLA_BACKEND_HIP_VARIANTS=quick: three splits and four combines (the corners) for a quick local check; CI runs all.
if os.environ.get("MLA_BACKEND_HIP_VARIANTS", "all") == "quick":
    SPLITS = [("bfloat16", "bfloat16", 16, 1, 64), ("float16", "float16", 128, 2, 1), ("bfloat16", FP8, 128, 2, 1)]
    COMBINES = [("bfloat16", 16, 1, False), ("bfloat16", 16, 1, True), ("float16", 128, 2, False),
                ("float16", 128, 2, True)]
GFX942_LDS_LIMIT = 64 * 1024  # bytes of LDS per workgroup (and per CU) on MI300X
# rocWMMA is in no Debian suite. TileLang's HIP common.h includes <rocwmma/rocwmma.hpp> but uses nothing of it
# except ``hip_bfloat16``, which rocWMMA's types header brings in from HIP's <hip/hip_bfloat16.h>: this stand-in
# includes exactly that (and the fp16 / vector headers rocWMMA's types header includes).
ROCWMMA_SHIM = "#pragma once\n#include <hip/hip_bfloat16.h>\n#include <hip/hip_fp16.h>\n#include <hip/hip_vector_types.h>\n"


def split_name(d, kv, h, q, p):
    return f"split-{d}{'' if kv == d else '-fp8'}-h{h}-q{q}-p{p}"


def combine_name(d, h, q, wide):
    return f"combine{'-wide' if wide else ''}-{d}-h{h}-q{q}"


# One worker: lowers its share of the kernels for gfx942, writes each HIP source and, where a compile command is
# given, compiles it to a code object right away (so lowering and compiling overlap across workers).
GENERATE = r"""
import json, subprocess, sys, time
import tilelang
from tilelang import tvm
from tvm.target import Target
from mla_backend.kernels import configs
from mla_backend.kernels.combine import build_combine_kernel
from mla_backend.kernels.portable import build_decode_kernel

out_dir, jobs, compile_cmd = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
target = Target(configs.target_for_arch("gfx942"))
report = {"tilelang": tilelang.__version__, "kernels": {}}
for name, kind, args in jobs:
    t0 = time.time()
    if kind == "split":
        d, kv, h, q, p = args
        func = build_decode_kernel(h, q, p, d, kv, configs.GFX942)
    else:
        d, h, q, wide = args
        func = build_combine_kernel(h, q, d, wide=wide)
    with tvm.transform.PassContext(config=configs.compat_pass_configs()), target:
        art = tilelang.lower(func, target=target, enable_device_compile=False)
    src = art.kernel_source
    dyn = [int(f.attrs["dyn_shared_memory_buf"]) for _, f in art.device_mod.functions.items()
           if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs]
    with open(f"{out_dir}/{name}.hip", "w") as f:
        f.write(src)
    entry = {"bytes": len(src), "mfma": src.count("__builtin_amdgcn_mfma"), "dyn_lds": max(dyn, default=0),
             "lower_s": round(time.time() - t0, 1)}
    if compile_cmd:
        t0 = time.time()
        proc = subprocess.run(compile_cmd + [f"{out_dir}/{name}.hip", "-o", f"{out_dir}/{name}.hsaco"],
                              capture_output=True, text=True)
        entry["compile_rc"], entry["compile_err"] = proc.returncode, proc.stderr[-3000:]
        entry["compile_s"] = round(time.time() - t0, 1)
    report["kernels"][name] = entry
print(json.dumps(report))
"""


def _llvm_tool(name: str) -> str | None:
    return shutil.which(f"{name}-19") or next(
        (c for c in (f"/usr/lib/llvm-19/bin/{name}",) if os.path.exists(c)), None)


def gfx942_toolchain() -> tuple[list[str] | None, str]:
    """The clang command that compiles a TileLang HIP source to a gfx942 code object (without the source and
    output), or None and why not."""
    clang, readelf = _llvm_tool("clang"), _llvm_tool("llvm-readelf")
    lld = _llvm_tool("ld.lld") or shutil.which("ld.lld")
    if clang is None or lld is None or readelf is None:
        return None, "Debian's clang-19 / lld-19 / llvm-19 are not installed (.ci/install_hip_toolchain.sh, root)"
    usr = ROCM_ROOT / "usr"
    if not (usr / "include" / "hip" / "hip_bf16.h").exists():
        return None, f"no ROCm >= 6 HIP headers under {usr} (.ci/install_hip_toolchain.sh unpacks libamdhip64-dev)"
    bitcode = sorted(glob.glob(str(usr / "lib" / "llvm-*" / "lib" / "clang" / "*" / "amdgcn" / "bitcode")))
    bitcode = [b for b in bitcode if os.path.exists(os.path.join(b, "oclc_isa_version_942.bc"))]
    if not bitcode:
        return None, f"no gfx942 device libraries under {usr} (.ci/install_hip_toolchain.sh unpacks rocm-device-libs-17)"
    tl = SIDE / "tilelang"
    shim = ROCM_ROOT / "shim"
    (shim / "rocwmma").mkdir(parents=True, exist_ok=True)
    (shim / "rocwmma" / "rocwmma.hpp").write_text(ROCWMMA_SHIM)
    # -isystem puts the ROCm 6 headers ahead of any HIP headers in /usr/include (bookworm's HIP 5.2, if installed);
    # TileLang's runtime compiles with hipcc -O3 -std=c++17, its templates and composable_kernel's include dir.
    return [clang, "-x", "hip", "--offload-arch=gfx942", "--cuda-device-only", "--no-gpu-bundle-output",
            f"--rocm-path={usr}", f"--rocm-device-lib-path={bitcode[0]}", "-isystem", str(usr / "include"),
            "-O3", "-std=c++17", "-Wno-parentheses-equality", f"-I{shim}", f"-I{tl / 'src'}",
            f"-I{tl / '3rdparty' / 'composable_kernel' / 'include'}", "-c"], ""


@pytest.fixture(scope="module")
def hip_build(tmp_path_factory):
    if not (SIDE / "tilelang").is_dir():
        pytest.skip(f"no TileLang with HIP codegen at {SIDE} (.ci/install_hip_toolchain.sh installs 0.1.11 there)")
    out = tmp_path_factory.mktemp("hip")
    compile_cmd, why_not = gfx942_toolchain()
    jobs = [(split_name(*v), "split", v) for v in SPLITS] + [(combine_name(*v), "combine", v) for v in COMBINES]
    # Importing TileLang 0.1.9 here (test collection does) exports its own library / tvm paths: drop them so
    # the subprocesses load 0.1.11 whole.
    inherited = ("PYTHONPATH", "TVM_LIBRARY_PATH", "TL_CUTLASS_PATH", "TL_COMPOSABLE_KERNEL_PATH", "TL_TEMPLATE_PATH")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    env["PYTHONPATH"] = os.pathsep.join([str(SIDE), str(ROOT)])
    procs = [subprocess.Popen([sys.executable, "-c", GENERATE, str(out), json.dumps(jobs[i::JOBS]),
                               json.dumps(compile_cmd or [])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(JOBS)]
    report = {"kernels": {}}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        assert proc.returncode == 0, stderr[-4000:]
        part = json.loads(stdout.strip().splitlines()[-1])
        report["tilelang"] = part["tilelang"]
        report["kernels"].update(part["kernels"])
    return out, report, compile_cmd, why_not


def test_hip_source_uses_mfma(hip_build):
    _, report, _, _ = hip_build
    assert report["tilelang"].startswith("0.1.1"), report  # the side install, not the main 0.1.9
    for v in SPLITS:
        entry = report["kernels"][split_name(*v)]
        assert entry["mfma"] > 0, f"split kernel {v}: no MFMA builtin in the HIP source"
        assert 0 < entry["dyn_lds"] <= GFX942_LDS_LIMIT, f"split kernel {v}: {entry['dyn_lds']} B of LDS"
        same_16bit = report["kernels"].get(split_name(v[0], v[0], *v[2:]))
        if v[1] == FP8 and same_16bit is not None:  # converted into the 16-bit tiles, no fp8 staging tile
            assert entry["dyn_lds"] == same_16bit["dyn_lds"], v
    for v in COMBINES:
        assert report["kernels"][combine_name(*v)]["bytes"] > 0


NOTE_KEYS = ("vgpr_count", "agpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count",
             "group_segment_fixed_size", "private_segment_fixed_size", "wavefront_size", "max_flat_workgroup_size")


def kernel_resources(readelf: str, hsaco: Path) -> dict:
    """Per kernel of a code object, its AMDGPU metadata (the NT_AMDGPU_METADATA note) as ints."""
    notes = subprocess.run([readelf, "--notes", str(hsaco)], capture_output=True, text=True, check=True).stdout
    # amdhsa.kernels is a YAML list: "  - .key: v" starts a kernel, "    .key: v" continues it (its .args nest deeper)
    kernels, cur = [], None
    for line in notes.splitlines():
        m = re.match(r"^  (- |  )\.(\w+):\s+(\S+)\s*$", line)
        if m is None:
            continue
        start, key, value = m.groups()
        if start == "- ":
            cur = {}
            kernels.append(cur)
        if cur is not None:
            cur[key] = int(value) if key in NOTE_KEYS else value
    kernels = {k["name"]: k for k in kernels}
    return kernels


def waves_per_simd(vgprs: int) -> int:
    """gfx942: 512 VGPRs (arch + acc, unified) per lane per SIMD, allocated in granules of 8; at most 8 waves."""
    return min(8, 512 // (-(-max(vgprs, 1) // 8) * 8))


def test_gfx942_code_objects(hip_build):
    """Every kernel compiles to a gfx942 code object that fits MI300X: LDS (static + dynamic) <= 64 KB, no
    scratch (no spills to memory), wave64; the resource table is printed (pytest -s) for docs/amd.md."""
    out, report, compile_cmd, why_not = hip_build
    if compile_cmd is None:
        pytest.skip(why_not)
    readelf = _llvm_tool("llvm-readelf")
    rows = []
    for name, entry in sorted(report["kernels"].items()):
        assert entry["compile_rc"] == 0, f"{name}: {' '.join(compile_cmd)} {name}.hip\n{entry['compile_err']}"
        res = kernel_resources(readelf, out / f"{name}.hsaco")
        assert len(res) == 1, f"{name}: expected one kernel in the code object, got {list(res)}"
        (r,) = res.values()
        lds = r["group_segment_fixed_size"] + entry["dyn_lds"]
        assert r["wavefront_size"] == 64 and r["max_flat_workgroup_size"] >= 128, (name, r)
        assert lds <= GFX942_LDS_LIMIT, f"{name}: {lds} B of LDS per workgroup, MI300X has {GFX942_LDS_LIMIT}"
        assert r["private_segment_fixed_size"] == 0 and r["vgpr_spill_count"] == 0, f"{name} spills: {r}"
        waves = waves_per_simd(r["vgpr_count"])
        assert waves >= 1, (name, r)
        # workgroups per CU: 4 SIMDs x waves / (waves per workgroup), and the CU's 64 KB of LDS
        wg_waves = r["max_flat_workgroup_size"] // 64
        wgs = min(4 * waves // wg_waves, GFX942_LDS_LIMIT // lds if lds else 32)
        rows.append(f"{name:<38}{r['vgpr_count']:>6}{r.get('agpr_count', '-'):>6}{r['sgpr_count']:>6}"
                    f"{r['sgpr_spill_count']:>7}{lds:>8}{r['private_segment_fixed_size']:>8}{waves:>7}{wgs:>6}"
                    f"{entry['lower_s']:>8}{entry['compile_s']:>8}")
    print(f"\n{'kernel':<38}{'VGPR':>6}{'AGPR':>6}{'SGPR':>6}{'sspill':>7}{'LDS':>8}{'scratch':>8}"
          f"{'w/SIMD':>7}{'WG/CU':>6}{'lower s':>8}{'cc s':>8}\n" + "\n".join(rows))


def test_gfx942_fp8_conversion(hip_build):
    """The fp8 split kernels convert the cache with gfx942's own instruction, v_cvt_f32_fp8, whose fp8 is MI300X's
    e4m3fnuz (the format dispatch takes there); the 16-bit kernels convert nothing."""
    out, report, compile_cmd, why_not = hip_build
    if compile_cmd is None:
        pytest.skip(why_not)
    objdump = _llvm_tool("llvm-objdump")
    if objdump is None:
        pytest.skip("no llvm-objdump-19 (llvm-19) to disassemble the code objects")
    for v in SPLITS:
        name = split_name(*v)
        asm = subprocess.run([objdump, "-d", str(out / f"{name}.hsaco")], capture_output=True, text=True,
                             check=True).stdout
        converts = len(re.findall(r"\bv_cvt_f32_fp8", asm))
        if v[1] == FP8:
            assert converts > 0, f"{name}: the fp8 cache is not converted with v_cvt_f32_fp8"
        else:
            assert converts == 0, f"{name}: {converts} fp8 conversions in a 16-bit kernel"

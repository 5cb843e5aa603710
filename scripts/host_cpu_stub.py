"""CPU only: the Python-side host work of one decode call, the two kernel launches stubbed out.

No GPU is needed: CPU tensors stand in for the device's, the dispatcher is told the device is an sm90 one, and the
compiled-kernel cache is seeded with stand-ins for the split and combine kernels. Two kinds of stand-in:

* ``tilelang``: TileLang 0.1.9's own per-call wrapper (``TVMFFIKernelAdapter``'s argument loop, built over the real
  PrimFuncs' parameters) in front of a no-op tvm-ffi function, i.e. everything but the tvm-ffi call itself;
* ``noop``: plain no-op callables (only the package's own Python work).

It times, per shape, p50 / p90 of: ``mla_decode`` as of a git revision (``--against``, default ea9c5e2^: the op
before the launcher, loaded from git), ``mla_decode`` of the working tree, and ``MLADecodeLauncher`` (with ``out``
given, the LSE not returned). The calls alternate in rounds so that a busy machine slows all of them alike.
    PYTHONPATH=$PWD python3 scripts/host_cpu_stub.py [--against REV] [--calls 20000] [--stub tilelang|noop]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((1, 16), (16, 128), (64, 128), (32, 32))  # (batch, heads); q_len 1, page 64, bf16
SCALE = 192**-0.5


def op_at(rev: str):
    """mla_backend/op.py at ``rev``, imported as a module of the working tree's package."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:mla_backend/op.py"], check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("mla_backend._op_at_rev", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "mla_backend"
    exec(compile(source, f"{rev}:mla_backend/op.py", "exec"), module.__dict__)
    return module


def tilelang_stand_in(prim_func):
    """A JITKernel whose call runs TileLang 0.1.9's tvm-ffi adapter wrapper over ``prim_func``'s parameters, in front
    of a module whose ``main`` does nothing (what ``kernels.runtime.launch_entry`` resolves to)."""
    from tilelang import tvm
    from tilelang.engine.param import KernelParam
    from tilelang.jit.adapter.tvm_ffi import TVMFFIKernelAdapter
    from tilelang.jit.kernel import JITKernel

    def main(*args):
        return None

    class Module:  # what tvm's load_module gives: __call__ -> self.main
        def get_function(self, name):
            return main

        def __call__(self, *args):
            return main(*args)

    adapter = TVMFFIKernelAdapter.__new__(TVMFFIKernelAdapter)
    adapter.params = [KernelParam.from_buffer(prim_func.buffer_map[v]) if v in prim_func.buffer_map
                      else KernelParam.from_var(v) for v in prim_func.params]
    adapter.result_idx = []
    adapter.ir_module = tvm.IRModule({"main": prim_func})
    adapter.executable = Module()
    adapter.func = adapter._convert_torch_func()
    kernel = JITKernel.__new__(JITKernel)
    kernel.adapter, kernel.execution_backend, kernel.torch_function = adapter, "tvm_ffi", adapter.func
    return kernel


def seed_kernels(heads: int, stub: str) -> None:
    from mla_backend.kernels import runtime
    from mla_backend.kernels.configs import config_for

    cfg = config_for("sm90")
    if stub == "noop":
        def noop(*args):
            return None
        split = combine = noop
    else:
        from mla_backend.kernels import combine as comb
        from mla_backend.kernels import sm90

        split = tilelang_stand_in(sm90.build_decode_kernel(heads, 1, 64, "bfloat16", "bfloat16", cfg))
        combine = tilelang_stand_in(comb.build_combine_kernel(heads, 1, "bfloat16", pdl=cfg.pdl))
    key = runtime._variant_key((heads, 1, 64, torch.bfloat16, torch.bfloat16, "sm90"), cfg)
    runtime._KERNELS[key] = runtime.Kernels(split, combine, combine, combine)


def problem(batch: int, heads: int):
    from mla_backend import MLADecodeMetadata, SplitPlanner

    lens = torch.full((batch,), 256, dtype=torch.int32)
    table = torch.arange(batch * 4, dtype=torch.int32).view(batch, 4)
    md = MLADecodeMetadata.from_block_table(table, lens, 64, q_len=1)
    md.plan = SplitPlanner(batch, heads, 1, "cpu", num_sms=132).plan(md.kv_lens)
    q = torch.randn(batch, heads, 576).bfloat16()
    kv = torch.randn(batch * 4, 64, 576).bfloat16()
    return q[..., :512], q[..., 512:], kv, md, torch.empty(batch, heads, 512, dtype=torch.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="ea9c5e2^", help="git revision of the mla_decode to compare with")
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per path and shape")
    parser.add_argument("--stub", choices=("tilelang", "noop"), default="tilelang")
    args = parser.parse_args()

    from mla_backend import MLADecodeLauncher, dispatch, mla_decode

    old = op_at(args.against)
    # The device is CPU; the dispatcher sees an sm90 one (planners were made with num_sms, before this).
    shapes = [(b, h, problem(b, h)) for b, h in SHAPES]
    dispatch.device_arch = lambda device: ("sm90", "stub sm90")
    dispatch.tilelang_available = lambda: True
    for h in sorted({h for _, h in SHAPES}):
        seed_kernels(h, args.stub)
    print(f"stand-in kernels: {args.stub}; {args.calls} calls per path; torch {torch.__version__}, "
          f"python {sys.version.split()[0]}")
    print(f"{'shape':<18}{'path':<34}{'p50 us':>9}{'p90 us':>9}")
    for b, h, (q_nope, q_pe, kv, md, out) in shapes:
        launch = MLADecodeLauncher("cpu", h, page_size=64, dtype=torch.bfloat16, softmax_scale=SCALE)
        assert not launch.variant(1).is_reference
        paths = {
            f"mla_decode @ {args.against}": lambda: old.mla_decode((q_nope, q_pe), kv, md, SCALE, out=out,
                                                                    check_indices=False),
            "mla_decode (working tree)": lambda: mla_decode((q_nope, q_pe), kv, md, SCALE, out=out,
                                                            check_indices=False),
            "MLADecodeLauncher": lambda: launch(q_nope, q_pe, kv, md, out),
        }
        times = {name: [] for name in paths}
        for fn in paths.values():
            for _ in range(200):
                fn()
        rounds = 20
        for _ in range(rounds):
            for name, fn in paths.items():
                ts = times[name]
                for _ in range(args.calls // rounds):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=10)
            print(f"{f'b={b} h={h}':<18}{name:<34}{statistics.median(ts) * 1e6:9.2f}{q[8] * 1e6:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

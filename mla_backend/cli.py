"""``mla-backend`` command line: ``selfcheck`` (the default), ``bench``, ``serve-bench`` and ``compile``.

``selfcheck`` prints the versions, the device and the implementation the dispatcher picks for a
DeepSeek-V3 shape, then runs ``mla_decode`` on fresh random data and checks it; exit status 1 on failure.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys

from . import installed

SCALE = 192**-0.5  # DeepSeek-V3's softmax scale (qk_nope 128 + rope 64), without the yarn factor
NOTHING_RAN = 2  # exit status of bench / serve-bench when nothing was measured (no GPU, nothing installed, all failed)


def nothing_ran(command: str, reason: str) -> int:
    """Says on stderr why ``mla-backend command`` measured nothing and returns :data:`NOTHING_RAN`."""
    print(f"mla-backend {command}: {reason}", file=sys.stderr)
    return NOTHING_RAN


def _version(dist: str) -> str:
    return installed.version(dist) or f"not installed (no distribution named {dist!r})"


def _tilelang_status() -> str:
    # tilelang is imported to compile the kernels, so a broken install must show here, not later.
    version = _version("tilelang")
    if version.startswith("not installed"):
        return version
    try:
        import tilelang  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return f"{version}, but import fails: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return version


def _device_line(torch) -> tuple[object, str]:
    if not torch.cuda.is_available():
        return torch.device("cpu"), f"no GPU (torch {torch.__version__}: torch.cuda.is_available() is False)"
    props = torch.cuda.get_device_properties(0)
    return torch.device("cuda"), f"{props.name}, compute capability {props.major}.{props.minor}, " \
                                 f"{props.multi_processor_count} SMs"


def naive_attention(q, kv_flat, pages, kv_len, page_size, scale):
    """Dense fp64 softmax attention of one request, written apart from the library.

    q ``[s_q, H, 576]``; kv_flat ``[num_pages * page_size, 576]``; pages: the request's page ids.
    Returns out ``[s_q, H, 512]`` and the natural-log lse ``[s_q, H]``.
    """
    import torch

    s_q, heads, _ = q.shape
    rows = [pages[t // page_size] * page_size + t % page_size for t in range(kv_len)]
    kv = kv_flat[rows].double()
    out = torch.zeros(s_q, heads, 512, dtype=torch.float64)
    lse = torch.full((s_q, heads), -math.inf, dtype=torch.float64)
    for i in range(s_q):
        seen = kv_len - s_q + i + 1  # causal: query i sees positions < seen
        if seen > 0:
            scores = q[i].double() @ kv[:seen].T * scale  # [H, seen]
            lse[i] = torch.logsumexp(scores, -1)
            out[i] = torch.softmax(scores, -1) @ kv[:seen, :512]
    return out, lse


def _check_case(torch, device, page_size: int, s_q: int, heads: int, seed: int) -> tuple[float, float]:
    """One random ragged problem; returns (op vs reference, reference vs naive) max relative errors."""
    from . import MLADecodeMetadata, mla_decode, mla_decode_reference

    g = torch.Generator().manual_seed(seed)
    lens = [0, 1, s_q, 2 * page_size + 3, 300]
    num_pages = [-(-n // page_size) for n in lens]
    perm = torch.randperm(sum(num_pages) + 2, generator=g).int()  # random page order, 2 pages unused
    table = torch.zeros(len(lens), max(num_pages), dtype=torch.int32)
    used = 0
    for r, n in enumerate(num_pages):
        table[r, :n] = perm[used:used + n]
        used += n
    kv_cache = torch.randn(len(perm), page_size, 576, generator=g).bfloat16()
    q = torch.randn(len(lens) * s_q, heads, 576, generator=g).bfloat16()
    md = MLADecodeMetadata.from_block_table(table, torch.tensor(lens, dtype=torch.int32), page_size, q_len=s_q)
    out, lse = mla_decode(q.to(device), kv_cache.to(device), md.to(device), SCALE, return_lse=True)
    ref, ref_lse = mla_decode_reference(q[..., :512], q[..., 512:], kv_cache, md, SCALE)

    def rel(a, b, la, lb):
        if not torch.equal(torch.isinf(la), torch.isinf(lb)) or torch.isnan(a).any():
            return math.inf
        finite = torch.isfinite(lb)
        lse_err = (la[finite].double() - lb[finite].double()).abs().max().item() if finite.any() else 0.0
        return max((a.double() - b.double()).abs().max().item() / b.double().abs().max().item(), lse_err)

    err_op = rel(out.cpu(), ref, lse.cpu(), ref_lse)
    naive = [naive_attention(q[r * s_q:(r + 1) * s_q], kv_cache.view(-1, 576), table[r].tolist(), n, page_size, SCALE)
             for r, n in enumerate(lens)]
    err_ref = rel(ref, torch.cat([o for o, _ in naive]), ref_lse, torch.cat([x for _, x in naive]))
    return err_op, err_ref


def selfcheck(_args=None) -> int:
    import torch

    from . import __version__
    from .dispatch import REFERENCE, select_impl

    print(f"mla-backend {__version__} selfcheck")
    print(f"  python    {platform.python_version()}")
    print(f"  torch     {torch.__version__}")
    print(f"  tilelang  {_tilelang_status()}")
    print(f"  vllm      {_version('vllm')}")
    print(f"  sglang    {_version('sglang')}")
    device, desc = _device_line(torch)
    print(f"device: {desc}")
    for heads in (128, 16):
        c = select_impl(device, torch.bfloat16, torch.bfloat16, heads, 1, 64)
        print(f"dispatch: DeepSeek-V3 bf16, {heads} heads, page 64, s_q 1 -> {c.impl} ({c.reason})")
    choice = select_impl(device, torch.bfloat16, torch.bfloat16, 16, 1, 64)
    if choice.impl == REFERENCE:
        print(f"running the reference path (PyTorch, fp32 accumulation) because there is no GPU kernel for this "
              f"device: {choice.reason}; checking it against a naive dense softmax attention")
    else:
        print(f"running {choice.impl} against the fp32 reference (and the reference against a naive attention)")
    # bf16 output: ~2^-8 relative rounding, plus accumulation order differences in the kernel
    tol = 2e-2
    ok = True
    for page_size in (16, 64):
        for s_q in (1, 2):
            err_op, err_ref = _check_case(torch, device, page_size, s_q, 16, seed=page_size * 10 + s_q)
            good = err_op <= tol and err_ref <= tol
            ok &= good
            print(f"  page {page_size:2d}, s_q {s_q}, 16 heads, lengths 0/1/s_q/2p+3/300: "
                  f"op vs reference {err_op:.1e}, reference vs naive {err_ref:.1e} {'ok' if good else 'FAIL'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def bench(argv: list[str]) -> int:
    try:
        from . import bench as bench_module
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.bench":
            raise
        print("mla-backend bench: mla_backend/bench.py is not in this install yet", file=sys.stderr)
        return 2
    return int(bench_module.main(argv) or 0)


def serve_bench(argv: list[str]) -> int:
    """The served-speed benchmark (``mla_backend/serve_bench``): every later argument goes to its driver."""
    from .serve_bench import driver

    return int(driver.main(argv) or 0)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def compile_kernels(args) -> int:
    """Compiles sm_90a kernel variants ahead of time (no GPU needed, nvcc is): into TileLang's disk cache, so that
    engines start without compiling, or with ``--into-package`` into the package's prebuilt folder for a wheel."""
    from .kernels import prebuilt

    kv_dtypes = _str_list(args.kv_dtype)
    unknown = [d for d in (args.dtype, *kv_dtypes) if d not in ("float16", "bfloat16", "float8_e4m3fn")]
    if unknown or args.dtype == "float8_e4m3fn":
        print(f"mla-backend compile: dtype/kv-dtype {unknown or [args.dtype]} not supported; expected float16 or "
              "bfloat16 (q), and those or float8_e4m3fn (cache)", file=sys.stderr)
        return 2
    from .kernels.configs import fp8_compute_applies

    fp8_compute = {"both": (False, True), "on": (True,), "off": (False,)}[args.fp8_compute]
    variants = [(h, s, p, args.dtype, kv, *((True,) if c else ())) for h in _int_list(args.heads)
                for s in _int_list(args.q_len) for p in _int_list(args.page) for kv in kv_dtypes
                for c in (fp8_compute if fp8_compute_applies("sm90", h, s, kv == "float8_e4m3fn") else (False,))]
    plans = _int_list(args.plan_batches)
    width = 30

    def progress(done: int, total: int, name: str, seconds: float) -> None:
        print(f"[{'#' * (width * done // total):<{width}}] {name}: {seconds:.1f}s ({done}/{total})", flush=True)

    print(f"compiling {len(variants)} kernel variants and {len(plans)} planners for sm_90a with {args.workers} "
          f"worker(s){' into the package' if args.into_package else ''}", flush=True)
    seconds = prebuilt.compile_variants(variants, plans, into_package=args.into_package, workers=args.workers,
                                        progress=progress, fresh=args.fresh)
    if args.into_package:
        kept = sorted(set(prebuilt.release_variants()) - set(seconds))
        if kept:
            print(f"kept from the folder's earlier build ({len(kept)}; --fresh rebuilds it from scratch): "
                  f"{', '.join(kept)}")
        root = prebuilt.release_dir()
        files = [f for f in root.rglob("*") if f.is_file()]
        print(f"{root}: {len(list((root / 'entries').iterdir()))} kernels, "
              f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB; the package carries kernels for TileLang "
              f"{', '.join(prebuilt.packaged_releases())}")
    print(f"done: {len(seconds)} compiled, {sum(seconds.values()):.0f} s of compile time")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .kernels import prebuilt

    parser = argparse.ArgumentParser(prog="mla-backend",
                                     description="MLA paged decode backend: self-check, benchmarks, ahead-of-time compile")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("selfcheck", help="versions, device, dispatch choice and a correctness check (default)")
    sub.add_parser("bench", help="the decode benchmark (--host: host time per call): every later argument goes to "
                                 "mla_backend.bench.main")
    sub.add_parser("serve-bench", help="served speed of our attention backend and the engine's built-in ones in vLLM or "
                                       "SGLang (one engine per backend): every later argument goes to "
                                       "mla_backend.serve_bench.driver.main")
    comp = sub.add_parser("compile", help="compile Hopper kernel variants ahead of time (into TileLang's cache)")
    join = ",".join
    comp.add_argument("--heads", default=join(map(str, prebuilt.ENGINE_HEADS)), help="query heads per GPU, comma list")
    comp.add_argument("--q-len", default=join(map(str, prebuilt.ENGINE_Q_LENS)), help="queries per request (1..4)")
    comp.add_argument("--page", default=join(map(str, prebuilt.ENGINE_PAGE_SIZES)), help="page sizes, comma list")
    comp.add_argument("--dtype", default=prebuilt.ENGINE_DTYPE, help="query dtype: bfloat16 or float16")
    comp.add_argument("--kv-dtype", default=join(prebuilt.ENGINE_KV_DTYPES), help="cache dtypes, comma list")
    comp.add_argument("--fp8-compute", choices=("both", "on", "off"), default="both",
                      help="an fp8 cache with more than 16 rows (heads x q_len): the e4m3-compute kernel (on), the "
                           "one that keeps q in 16 bits (off), or both (default; engines pick with "
                           "MLA_BACKEND_FP8_COMPUTE)")
    comp.add_argument("--plan-batches", default=join(map(str, prebuilt.ENGINE_PLAN_BATCHES)),
                      help="largest batch of each one-launch planner variant (powers of two from 256)")
    comp.add_argument("--workers", type=int, default=1, help="parallel compile processes")
    comp.add_argument("--into-package", action="store_true",
                      help="write the package's prebuilt folder for the installed TileLang (for building a wheel) instead of "
                           "TileLang's cache")
    comp.add_argument("--fresh", action="store_true",
                      help="with --into-package: drop the variants the folder already holds (default: keep those "
                           "this call does not compile)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # forwarded untouched: argparse would try to parse the benchmark's own options
        return bench(argv[1:])
    if argv[:1] == ["serve-bench"]:
        return serve_bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "compile":
        return compile_kernels(args)
    return selfcheck(args)


if __name__ == "__main__":
    sys.exit(main())

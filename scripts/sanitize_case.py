"""Small decode cases for compute-sanitizer (memcheck / racecheck): every kernel the op launches
(split planner, ws decode bf16 / fp8 / s_q=2 causal / TMA blocks at page 64, combine) on ragged lengths incl. 0, 1, 63, 65,
pages in random order, page sizes 1 / 16 / 64, and one long request beside short ones (split into more than 8
parts: the combine's block-wide LSE reduction). Run once plain (compiles into TILELANG_CACHE_DIR),
then under the sanitizer, which then only loads the cached kernels. Exits 1 on a wrong result.
``--cases 2,3``: only these entries of CASES (indices)."""
import sys

import torch

from mla_backend import MLADecodeMetadata, mla_decode, mla_decode_reference

SHORT = (0, 1, 63, 65, 700, 130)
LONG = (20000, 1, 65, 3)
CASES = [  # (page_size, heads, q_len, fp8, kv lens)
    (64, 16, 1, False, SHORT), (1, 16, 1, False, SHORT), (16, 128, 2, False, SHORT), (64, 128, 1, False, SHORT),
    (64, 16, 1, True, SHORT),
    (16, 32, 2, True, SHORT), (64, 16, 1, False, LONG), (64, 16, 1, True, LONG)]


def run_case(page_size: int, heads: int, q_len: int, fp8: bool, kv_lens: tuple) -> float:
    torch.manual_seed(page_size * 7 + heads + q_len)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    pages_per_req = -(-int(lens.max()) // page_size)
    num_pages = pages_per_req * len(lens) + 3
    kv = torch.randn(num_pages, page_size, 576, device="cuda").bfloat16()
    if fp8:
        kv = (kv * 2).to(torch.float8_e4m3fn)
    table = torch.randperm(num_pages, device="cuda")[: pages_per_req * len(lens)].int().view(len(lens), -1)
    q = torch.randn(len(lens) * q_len, heads, 576, device="cuda").bfloat16()
    md = MLADecodeMetadata.from_block_table(table, lens.cuda(), page_size, q_len=q_len)
    out = torch.full((q.shape[0], heads, 512), float("nan"), device="cuda", dtype=q.dtype)
    scale = 0.5 if fp8 else None
    mla_decode(q, kv, md, 0.07, out=out, k_scale=scale)
    torch.cuda.synchronize()
    ref, _ = mla_decode_reference(q[..., :512], q[..., 512:], kv, md, 0.07, k_scale=scale or 1.0)
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def main() -> int:
    bad = 0
    picked = [int(i) for i in sys.argv[sys.argv.index("--cases") + 1].split(",")] if "--cases" in sys.argv else None
    for case in (CASES if picked is None else [CASES[i] for i in picked]):
        err = run_case(*case)
        print(f"page={case[0]:3d} h={case[1]:3d} s_q={case[2]} fp8={case[3]!s:5} lens={case[4]}: rel err {err:.2e}",
              flush=True)
        bad += not err < 2e-2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

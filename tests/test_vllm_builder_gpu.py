"""vLLM's per-step metadata builder (``vllm_plugin.translate.DecodeMetadataBuilder``) on the kernel path, without
vLLM: the metadata it hands out again over persistent buffers gives the bits of metadata made afresh from a copy of
the step's rows, eagerly and in CUDA-graph replays captured on an earlier step (marked gpu: skipped without one)."""

from __future__ import annotations

import pytest
import torch

from mla_backend import MLADecodeLauncher, MLADecodeMetadata, SplitPlanner, mla_decode, mla_decode_reference
from mla_backend.dispatch import select_impl
from mla_backend.vllm_plugin.translate import DecodeMetadataBuilder

HEADS, PAGE, MAX_BATCH, MAX_PAGES = 16, 64, 8, 24
pytestmark = [pytest.mark.gpu, pytest.mark.mla_kernels(heads=HEADS, plans=(MAX_BATCH,))]

SCALE = 192**-0.5
BF16 = torch.bfloat16


def _fill_step(table, seq_lens, batch, g):
    """What vLLM's model runner does between steps: new rows and lengths written into its persistent buffers (rows
    past ``batch`` keep stale values). Returns the step's lengths."""
    lens = torch.randint(1, MAX_PAGES * PAGE, (batch,), generator=g)
    lens[0] = 1
    table.copy_(torch.randperm(table.numel(), generator=g).view_as(table).int())
    seq_lens[:batch].copy_(lens.int())
    return lens.tolist()


def test_handed_out_again_metadata_gives_fresh_metadata_s_bits_eager_and_in_graph_replays():
    if select_impl(torch.device("cuda"), BF16, BF16, HEADS, 1, PAGE).impl == "reference":
        pytest.skip("no kernel for this GPU")
    g = torch.Generator().manual_seed(3)
    num_pages = MAX_BATCH * MAX_PAGES
    cache = torch.randn(num_pages, PAGE, 576, generator=g).to(BF16).cuda()
    table = torch.zeros(MAX_BATCH, MAX_PAGES, dtype=torch.int32, device="cuda")  # vLLM's persistent block table
    seq_lens = torch.zeros(MAX_BATCH, dtype=torch.int32, device="cuda")  # and its persistent seq_lens
    q_nope = torch.randn(MAX_BATCH, HEADS, 512, generator=g).to(BF16).cuda()
    q_pe = torch.randn(MAX_BATCH, HEADS, 64, generator=g).to(BF16).cuda()
    builder = DecodeMetadataBuilder(MAX_BATCH, HEADS, PAGE, (1,), "cuda")
    fresh_planner = SplitPlanner(MAX_BATCH, HEADS, 1, "cuda")  # the builder's planner's arguments: the same plan
    launch = MLADecodeLauncher("cuda", HEADS, page_size=PAGE, dtype=BF16, softmax_scale=SCALE, q_lens=(1,))
    graphs: dict[int, tuple] = {}  # batch -> (graph, its output, the metadata object it captured)
    for step, batch in enumerate([8, 5, 8, 3, 5, 8, 3]):
        lens = _fill_step(table, seq_lens, batch, g)
        md = builder.build(table[:batch], seq_lens[:batch], torch.arange(batch + 1, dtype=torch.int32), batch,
                           max(lens))
        fresh = MLADecodeMetadata.from_block_table(table[:batch].clone(), seq_lens[:batch].clone(), PAGE, q_len=1)
        fresh.plan = fresh_planner.plan(fresh.kv_lens)
        want, want_lse = mla_decode((q_nope[:batch], q_pe[:batch]), cache, fresh, SCALE, return_lse=True)
        eager, lse = launch(q_nope[:batch], q_pe[:batch], cache, md, return_lse=True)
        assert torch.equal(eager, want) and torch.equal(lse, want_lse), f"step {step}: eager call, batch {batch}"
        if batch in graphs:
            graph, out, captured = graphs[batch]
            assert md is captured, "the builder made a new object for the same storage and batch"
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), f"step {step}: graph replay, batch {batch}"
        else:
            out = torch.empty(batch, HEADS, 512, dtype=BF16, device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launch(q_nope[:batch], q_pe[:batch], cache, md, out)
            graphs[batch] = (graph, out, md)
    ref, _ = mla_decode_reference(q_nope[:batch].cpu(), q_pe[:batch].cpu(), cache.cpu(), fresh.to("cpu"), SCALE)
    err = (want.float().cpu() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.3e} against the fp32 reference"

"""GPU unit tests of the SGLang plugin (``tilelang_mla``) with SGLang's own attention unit kit.

Needs an sm90 GPU, sglang==0.5.17 (its wheel ships ``sglang/test/kits/attention_unittest``),
tilelang and this package. The kit builds a backend with ``ATTENTION_BACKENDS[case.backend](runner)``
(a mock ``ModelRunner`` with SGLang's real ``ReqToTokenPool`` and ``MLATokenToKVPool``), so a
registered out-of-tree backend is tested as is. All cases use DeepSeek-V3's MLA shape
(kv_lora_rank 512, rope 64) with 16 heads.

    python tests/e2e/sglang_unit.py --out /tmp/sglang_unit.json [-k decode] [-v]

What is checked:
  * register(): registry, CLI choices, DeepSeek handler; idempotence.
  * decode (page 1 / 16 / 64, ragged lengths incl. 1 and page edges, shuffled / interleaved pages):
    tilelang_mla vs the kit's float reference and vs SGLang's triton backend on identical inputs;
    flashmla too at page 64 (skipped if it cannot be built here).
  * fp8_e4m3 KV: tilelang_mla vs triton reading the same fp8 cache.
  * the kit's CUDA-graph decode / verify flows (capture-time + padded replay-time metadata).
  * a real torch.cuda.CUDAGraph capture of the whole tiny MLA layer, replayed on a different batch
    (decode and target-verify), against the reference.
  * target-verify (EAGLE/MTP topk 1, 2..4 draft tokens) against the kit's masked reference.
  * extend cases (delegated to the Triton backend inside tilelang_mla).
  * SGLang's page-table Triton kernel == the pure-torch translation CI tests.
  * startup refusals (page size 3, 256 heads).
Results (per test: status, metrics, error tail) go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

BACKEND = "tilelang_mla"
SHAPE = dict(kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=1024)
HEADS = 16
METRICS: dict = {}
DEVICE = "cuda"  # --device cpu: debug the flows without a GPU (reference op, no other backends, no graphs)


def _need_cuda(test: unittest.TestCase):
    if DEVICE != "cuda":
        test.skipTest("needs CUDA")


def _metric(test: unittest.TestCase, **values):
    METRICS.setdefault(test.id().split(".", 1)[-1], {}).update(values)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _kit():
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as K

    return K


def _case(name, mode, page_size, prefix_lens, extend_lens=(), backend=BACKEND, heads=HEADS):
    K = _kit()
    return K.MLAAttentionCase(name=name, backend=backend, forward_mode=mode, num_heads=heads, page_size=page_size,
                              prefix_lens=tuple(prefix_lens), extend_lens=tuple(extend_lens))


def _mode(name):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return getattr(ForwardMode, name)


DECODE_PREFIXES = {
    1: (0, 1, 7, 33, 100, 255),
    16: (0, 14, 15, 16, 47, 130),
    64: (0, 63, 64, 65, 130, 200),
}


class PluginRegistration(unittest.TestCase):
    def test_register(self):
        import mla_backend.sglang_plugin as plugin

        plugin.register()
        plugin.register()
        from sglang.srt import server_args as sa
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

        self.assertIn(BACKEND, ATTENTION_BACKENDS)
        self.assertEqual(sa.ATTENTION_BACKEND_CHOICES.count(BACKEND), 1)
        self.assertTrue(plugin.register_deepseek_handler())
        from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

        self.assertIs(AttentionBackendRegistry.get_handler(BACKEND), plugin.deepseek_attention_handler)
        try:
            from importlib.metadata import entry_points

            eps = [ep.value for ep in entry_points(group="sglang.srt.plugins")]
        except Exception:  # pragma: no cover
            eps = []
        _metric(self, entry_points=eps, entry_point_installed="mla_backend.sglang_plugin:register" in eps)


class Decode(unittest.TestCase):
    def _compare(self, page_size, prefixes, *, dtype=torch.bfloat16, loc_layout="shuffled_pages", fp8=False,
                 others=("triton",), max_context_len=320):
        K = _kit()
        mode = _mode("DECODE")
        name = f"decode_p{page_size}"
        kw = dict(**SHAPE, max_context_len=max_context_len, dtype=dtype, device=DEVICE, loc_layout=loc_layout,
                  fp8_kv_cache=fp8)
        if DEVICE != "cuda":
            others = ()
        ours = K.build_mla_attention_fixture(self, _case(name, mode, page_size, prefixes), **kw)
        out = K.run_mla_fixture_eager(ours)
        ref = K.expected_mla_fixture_output(ours)
        metrics = {"err_vs_reference": _max_err(out, ref)}
        if not fp8:
            torch.testing.assert_close(out, ref, atol=K.MLA_ATOL, rtol=K.MLA_RTOL)
        for other in others:
            try:
                fx = K.build_mla_attention_fixture(self, _case(name, mode, page_size, prefixes, backend=other), **kw)
            except unittest.SkipTest as exc:
                metrics[f"{other}"] = f"skipped: {exc}"
                continue
            except Exception as exc:  # noqa: BLE001 - an in-tree backend that cannot run here
                metrics[f"{other}"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
                continue
            self.assertTrue(torch.equal(fx.input_hidden, ours.input_hidden), "fixtures differ (seeding)")
            try:
                other_out = K.run_mla_fixture_eager(fx)
            except Exception as exc:  # noqa: BLE001
                if other == "triton":  # the baseline must run
                    raise
                metrics[f"{other}"] = f"failed in the kit's mock runner: {type(exc).__name__}: {exc}"[:300]
                continue
            metrics[f"err_vs_{other}"] = _max_err(out, other_out)
            metrics[f"{other}_err_vs_reference"] = _max_err(other_out, ref)
            torch.testing.assert_close(out, other_out, atol=K.MLA_ATOL, rtol=K.MLA_RTOL)
        _metric(self, **metrics)

    def test_decode_page1(self):
        self._compare(1, DECODE_PREFIXES[1])

    def test_decode_page16(self):
        self._compare(16, DECODE_PREFIXES[16])

    def test_decode_page64(self):
        self._compare(64, DECODE_PREFIXES[64], others=("triton", "flashmla"))

    def test_decode_page16_interleaved_pages(self):
        self._compare(16, DECODE_PREFIXES[16], loc_layout="interleaved_pages")

    def test_decode_page64_fp16(self):
        self._compare(64, DECODE_PREFIXES[64], dtype=torch.float16)

    def test_decode_fp8_page64(self):
        self._compare(64, DECODE_PREFIXES[64], fp8=True, others=("triton", "flashmla"))

    def test_decode_fp8_page16(self):
        self._compare(16, DECODE_PREFIXES[16], fp8=True)

    def test_decode_single_request_long(self):
        self._compare(64, (700,), max_context_len=768)


class DecodeCudaGraphKit(unittest.TestCase):
    def _run(self, page_size, prefixes):
        from sglang.test.kits.attention_unittest.runner_modes.cuda_graph_decode_runner import (
            run_mla_cuda_graph_decode_case,
        )

        run_mla_cuda_graph_decode_case(self, _case(f"cg_decode_p{page_size}", _mode("DECODE"), page_size, prefixes),
                                       **SHAPE, max_context_len=256, dtype=torch.bfloat16, device=DEVICE,
                                       cuda_graph_capture_batch_size=4)

    def test_cuda_graph_decode_page1_padded(self):
        self._run(1, (5, 40))

    def test_cuda_graph_decode_page16(self):
        self._run(16, (14, 15, 16))

    def test_cuda_graph_decode_page64(self):
        self._run(64, (63, 64, 65, 130))


class Verify(unittest.TestCase):
    def _run(self, page_size, n_draft, prefixes):
        from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
            run_mla_eagle_verify_case,
        )

        case = _case(f"verify_p{page_size}_n{n_draft}", _mode("TARGET_VERIFY"), page_size, prefixes,
                     (n_draft,) * len(prefixes))
        run_mla_eagle_verify_case(self, case, topk=1, **SHAPE, max_context_len=256, dtype=torch.bfloat16,
                                  device=DEVICE)

    def test_verify_page1_n2(self):
        self._run(1, 2, (0, 9, 100))

    def test_verify_page16_n3(self):
        self._run(16, 3, (13, 14, 16, 40))

    def test_verify_page64_n4(self):
        self._run(64, 4, (0, 60, 64, 150))

    def test_verify_cuda_graph_kit_page64_n4(self):
        # Single-page requests only: the kit's eager leg here pairs the fixture's shuffled-page
        # req_to_token with a contiguous prefix-KV write (prepare_mla_runner_inputs has no loc_fn), which
        # breaks any backend on multi-page requests. RealCudaGraph covers multi-page verify.
        from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
            run_mla_eagle_verify_cuda_graph_case,
        )

        case = _case("cg_verify_p64", _mode("TARGET_VERIFY"), 64, (10, 33, 59), (4, 4, 4))
        run_mla_eagle_verify_cuda_graph_case(self, case, topk=1, **SHAPE, max_context_len=256, dtype=torch.bfloat16,
                                             device=DEVICE, cuda_graph_capture_batch_size=4)


class RealCudaGraph(unittest.TestCase):
    """Capture the tiny MLA layer (KV write + tilelang_mla) in a torch.cuda.CUDAGraph, then replay it on a
    different batch after refreshing only the metadata (what SGLang's decode graph runner does)."""

    def _run(self, page_size, mode_name, capture_prefix, replay_prefix, n_draft=0):
        K = _kit()
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
        from sglang.test.kits.attention_unittest.attention_methods.dense_attention import make_loc_fn
        from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as V

        dev = DEVICE
        mode = _mode(mode_name)
        verify = mode.is_target_verify()
        bs, max_ctx = len(capture_prefix), 320
        ext = (n_draft,) * bs if verify else ()
        cap_case = _case(f"real_cg_{mode_name}_p{page_size}", mode, page_size, capture_prefix, ext)
        fx = K.build_mla_attention_fixture(self, cap_case, **SHAPE, max_context_len=max_ctx, dtype=torch.bfloat16,
                                           device=dev, disable_cuda_graph=False, runner_batch_size=bs)
        backend, runner, module, batch = fx.backend, fx.runner, fx.actual_module, fx.forward_batch
        if verify:
            V._prepare_spec_verify_batch(cap_case, batch, topk=1, spec_kind="eagle", device=dev)
        backend.init_cuda_graph_state(bs, batch.input_ids.numel())
        static_hidden = fx.input_hidden.clone()
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            backend.init_forward_metadata_out_graph(batch, in_capture=True)
            backend.init_forward_metadata_in_graph(batch)
            if dev == "cuda":
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        module(static_hidden, batch)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = module(static_hidden, batch)
                replay = graph.replay
            else:  # --device cpu debugging: re-run the Python forward instead of a real replay
                static_out = module(static_hidden, batch)

                def replay():
                    static_out.copy_(module(static_hidden, batch))

            rep_case = _case(f"real_cg_replay_{mode_name}_p{page_size}", mode, page_size, replay_prefix, ext)
            loc_fn = make_loc_fn("shuffled_pages", batch_size=bs, seq_lens=rep_case.seq_lens,
                                 prefix_lens=rep_case.prefix_lens, page_size=page_size, max_context_len=max_ctx,
                                 seed=11)
            rep = K._make_forward_batch(rep_case, runner, max_context_len=max_ctx, device=dev, loc_fn=loc_fn)
            if verify:
                V._prepare_spec_verify_batch(rep_case, rep, topk=1, spec_kind="eagle", device=dev)
            torch.manual_seed(5)
            prefix_hidden = [torch.randn(p, SHAPE["hidden_size"], dtype=torch.bfloat16, device=dev)
                             for p in rep_case.prefix_lens]
            input_hidden = torch.randn(static_hidden.shape, dtype=torch.bfloat16, device=dev)
            K._populate_prefix_kv(module, rep_case, runner, backend, prefix_hidden, max_context_len=max_ctx,
                                  loc_fn=loc_fn)
            # Refresh the captured batch's tensors in place (the graph reads out_cache_loc directly).
            for field in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
                getattr(batch, field).copy_(getattr(rep, field))
            batch.seq_lens_cpu = rep.seq_lens_cpu
            batch.spec_info = rep.spec_info
            static_hidden.copy_(input_hidden)
            backend.init_forward_metadata_out_graph(batch)  # replay prep
            replay()
            if dev == "cuda":
                torch.cuda.synchronize()
            replayed = static_out.clone()
            backend.init_forward_metadata(batch)  # eager on the same batch
            eager = module(static_hidden, batch)
        if verify:
            masks, _ = V._make_custom_masks(rep_case, topk=1, device=dev)
            expected = K.mla_attention_reference_with_custom_mask(fx.reference_module, rep_case, prefix_hidden,
                                                                  input_hidden, masks)
        else:
            expected = K._mla_attention_reference(fx.reference_module, rep_case, prefix_hidden, input_hidden)
        _metric(self, replay_err_vs_reference=_max_err(replayed, expected), replay_err_vs_eager=_max_err(replayed, eager),
                real_cuda_graph=dev == "cuda")
        torch.testing.assert_close(replayed, expected, atol=K.MLA_ATOL, rtol=K.MLA_RTOL)
        torch.testing.assert_close(replayed, eager, atol=1e-2, rtol=1e-2)

    def test_real_graph_decode_page1(self):
        self._run(1, "DECODE", (8, 8, 8, 8), (100, 0, 64, 17))

    def test_real_graph_decode_page64(self):
        self._run(64, "DECODE", (8, 8, 8, 8), (200, 63, 0, 64))

    def test_real_graph_verify_page64(self):
        self._run(64, "TARGET_VERIFY", (8, 8, 8), (150, 0, 61), n_draft=4)

    def test_real_graph_verify_page16(self):
        self._run(16, "TARGET_VERIFY", (8, 8, 8), (30, 1, 77), n_draft=2)


class ExtendDelegation(unittest.TestCase):
    def test_kit_extend_cases(self):
        _need_cuda(self)  # extend runs SGLang's Triton kernels
        K = _kit()
        ran = []
        for case in K.make_mla_cases(BACKEND):
            if case.forward_mode.is_decode():
                continue
            case = K.MLAAttentionCase(name=case.name, backend=BACKEND, forward_mode=case.forward_mode,
                                      num_heads=HEADS, page_size=case.page_size, prefix_lens=case.prefix_lens,
                                      extend_lens=case.extend_lens)
            with self.subTest(case=case.name):
                K.run_mla_attention_case(self, case, **SHAPE, max_context_len=64, dtype=torch.bfloat16)
                ran.append(case.name)
        _metric(self, cases=ran)


class PageTable(unittest.TestCase):
    def test_triton_fill_matches_torch(self):
        _need_cuda(self)
        from mla_backend.sglang_plugin.backend import _make_triton_fill
        from mla_backend.sglang_plugin.page_table import fill_page_table_torch, num_pages

        fill = _make_triton_fill()
        self.assertIsNotNone(fill, "SGLang's create_flashmla_kv_indices_triton is unavailable")
        gen = torch.Generator(device="cuda").manual_seed(0)
        for page_size in (1, 16, 64):
            rows, ctx, bs = 40, 4096 + 64, 33
            req_to_token = torch.randint(0, 1 << 20, (rows, ctx), dtype=torch.int32, device="cuda", generator=gen)
            req = torch.randperm(rows, device="cuda", generator=gen)[:bs]
            kv_lens = torch.randint(1, ctx, (bs,), dtype=torch.int32, device="cuda", generator=gen)
            width = -(-ctx // page_size)
            a = torch.full((bs + 3, width), -1, dtype=torch.int32, device="cuda")
            b = torch.zeros_like(a)
            fill(req_to_token, req, kv_lens, page_size, a[:bs])
            fill_page_table_torch(req_to_token, req, kv_lens, page_size, b[:bs])
            used = torch.arange(width, device="cuda")[None, :] < num_pages(kv_lens, page_size)[:, None]
            self.assertTrue(torch.equal(a[:bs][used], b[:bs][used]), f"page {page_size}")
            self.assertTrue(bool((a[bs:] == -1).all()))


class Refusals(unittest.TestCase):
    def _build(self, case):
        K = _kit()
        return K.build_mla_attention_fixture(self, case, **SHAPE, max_context_len=64, dtype=torch.bfloat16,
                                             device=DEVICE)

    def test_page_size_3_refused(self):
        with self.assertRaisesRegex(ValueError, "tilelang_mla: --page-size 3"):
            self._build(_case("bad_page", _mode("DECODE"), 3, (5,)))

    def test_256_heads_refused(self):
        with self.assertRaisesRegex(ValueError, "tilelang_mla: 256 query heads"):
            self._build(_case("bad_heads", _mode("DECODE"), 16, (5,), heads=256))


class _Result(unittest.TextTestResult):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.records = {}
        self._t0 = {}

    def _key(self, test):
        return test.id().split(".", 1)[-1]

    def startTest(self, test):
        self._t0[self._key(test)] = time.perf_counter()
        super().startTest(test)

    def _rec(self, test, status, err=None):
        key = self._key(test)
        rec = self.records.setdefault(key, {"status": status})
        if rec["status"] == "pass" or status != "pass":
            rec["status"] = status
        rec["seconds"] = round(time.perf_counter() - self._t0.get(key, time.perf_counter()), 2)
        if err is not None:
            rec.setdefault("errors", []).append("".join(traceback.format_exception(*err))[-2500:])

    def addSuccess(self, test):
        super().addSuccess(test)
        self._rec(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._rec(test, "fail", err)

    def addError(self, test, err):
        super().addError(test, err)
        self._rec(test, "error", err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._rec(test, "skip")
        self.records[self._key(test)]["reason"] = reason

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._rec(test, "fail" if issubclass(err[0], test.failureException) else "error", err)


def _cpu_debug_setup():
    """No GPU: the reference op, and SGLang's Triton MLA KV write replaced by its torch equivalent."""
    os.environ.setdefault("MLA_BACKEND_IMPL", "reference")
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope):
        buf = self.kv_buffer[layer.layer_id - self.start_layer]
        val = torch.cat([cache_k_nope, cache_k_rope], dim=-1).to(self.dtype)
        buf[loc] = val.view(self.store_dtype) if self.store_dtype != self.dtype else val

    MLATokenToKVPool.set_mla_kv_buffer = set_mla_kv_buffer


def _single_rank_parallel_defaults():
    """SGLang 0.5.23 raises on reading ``get_parallel().attn_dcp_rank`` (``TritonAttnBackend.__init__``
    does) until a server publishes its config, which the kit's fixtures do not do; state the
    single-rank value (DCP off) as SGLang's own ``publish`` does. 0.5.17 reads a default instead and
    has no ``override_permanently``: nothing to do there."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if not hasattr(parallel, "override_permanently"):
        return
    try:
        parallel.attn_dcp_rank
    except RuntimeError:
        parallel.override_permanently(attn_dcp_rank=0)


def _env() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("sglang", "tilelang", "triton", "mla_backend"):
        try:
            info[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            info[mod] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", default=None, help="write results JSON here")
    parser.add_argument("-k", action="append", default=[], help="only tests whose id contains this (repeatable)")
    parser.add_argument("-v", action="store_true")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE != "cuda":
        _cpu_debug_setup()

    import mla_backend.sglang_plugin as plugin

    plugin.register()  # the kit process loads no entry points itself
    _single_rank_parallel_defaults()
    loader = unittest.TestLoader()
    suite = loader.loadTestsFromModule(sys.modules[__name__])
    if args.k:
        def keep(t):
            return any(k in t.id() for k in args.k)

        flat = []

        def walk(s):
            for t in s:
                walk(t) if isinstance(t, unittest.TestSuite) else flat.append(t)

        walk(suite)
        suite = unittest.TestSuite([t for t in flat if keep(t)])
    start = time.perf_counter()
    runner = unittest.TextTestRunner(verbosity=2 if args.v else 1, resultclass=_Result)
    result = runner.run(suite)
    records = result.records
    for key, metrics in METRICS.items():
        records.setdefault(key, {"status": "?"})["metrics"] = metrics
    summary = {s: sum(1 for r in records.values() if r["status"] == s) for s in ("pass", "fail", "error", "skip")}
    report = {"summary": summary, "ok": result.wasSuccessful(), "seconds": round(time.perf_counter() - start, 1),
              "env": _env(), "tests": records}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)
    print(json.dumps({"summary": summary, "ok": report["ok"], "seconds": report["seconds"]}))
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())

"""The SGLang plugin against SGLang's real Python package, on CPU (no GPU, no kernel runs).

Runs only where ``sglang`` is importable (CI: ``.ci/install_sglang.sh`` puts sglang 0.5.23's package in
``.ci/sglang-site`` and ``.ci/run`` runs this file with ``PYTHONPATH=.ci/sglang-site``); skipped otherwise.
Checks, with SGLang's own objects (nothing of SGLang is mocked):

* the ``sglang.srt.plugins`` entry point, loaded by SGLang's plugin loader, registers ``tilelang_mla``
  in ``ATTENTION_BACKENDS`` and the ``--attention-backend`` choices (needs this package installed);
* ``register()`` called directly, twice: same registry entry, the name once in the choices;
* SGLang's CLI parser accepts the name for ``--attention-backend`` / ``--decode-attention-backend`` /
  ``--prefill-attention-backend`` and rejects an unregistered one;
* the DeepSeek-V2/V3 dispatch: our handler is what DeepSeek's registry returns for the name, and it picks
  the same attention method as SGLang's Triton handler for real ``ForwardBatch`` objects (decode and
  verify -> absorbed MLA, prefill without a cached prefix -> MHA, with one -> MLA);
* ``TileLangMLABackend`` subclasses SGLang's ``AttentionBackend`` and accepts every argument the base
  methods SGLang calls take;
* SGLang's page-table Triton kernel is found at its location in the installed release;
* startup refusals through SGLang's own MLA attention test kit (``sglang.test.kits``; its model runner
  with SGLang's real req-to-token and MLA KV pools), and a successful construction on CPU with the
  reference implementation (which also builds SGLang's Triton backend for prefill delegation);
* the prefill backend's choice (``MLA_BACKEND_SGLANG_PREFILL``), the chunked prefix cache and the DeepSeek
  dispatch that follow a FlashInfer prefill, and its refusal where FlashInfer's backend cannot be built.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import sys

import pytest

from sglang_cpu_env import prepare_cpu_torchvision

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (CI: .ci/install_sglang.sh installs it in .ci/sglang-site; run "
                "with PYTHONPATH=.ci/sglang-site)", allow_module_level=True)

prepare_cpu_torchvision()  # before the first sglang import; a no-op where torchvision's extension loads
import sglang  # noqa: E402  (a broken install fails here instead of skipping)
import torch  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt import server_args as sglang_server_args  # noqa: E402
from sglang.srt.layers.attention import attention_registry  # noqa: E402
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

import mla_backend.sglang_plugin as plugin  # noqa: E402
from mla_backend.sglang_plugin import BACKEND_NAME  # noqa: E402

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT = "mla_backend.sglang_plugin:register"


def _unregister():
    """Undo every registration (SGLang's registries and this package's flags)."""
    attention_registry.ATTENTION_BACKENDS.pop(BACKEND_NAME, None)
    choices = sglang_server_args.ATTENTION_BACKEND_CHOICES
    while BACKEND_NAME in choices:
        choices.remove(BACKEND_NAME)
    plugin._registered = False


@pytest.fixture
def unregistered():
    _unregister()
    yield
    plugin.register()  # leave it registered for the other tests


def _assert_registered():
    assert attention_registry.ATTENTION_BACKENDS.get(BACKEND_NAME) is plugin.create_backend
    assert sglang_server_args.ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) == 1


def _our_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.value == ENTRY_POINT]
    if not eps:
        pytest.skip(f"no {ENTRY_POINT_GROUP} entry point -> {ENTRY_POINT} is visible: this package is not "
                    "installed (pip install -e .)")
    return eps[0]


def test_version_reported():
    assert sglang.__version__ and sglang.__version__ != "0.0.0.dev0", sglang.__version__


def test_entry_point_loaded_by_sglang_plugin_loader(unregistered, monkeypatch):
    ep = _our_entry_point()
    from sglang.srt import plugins as sglang_plugins

    assert sglang_plugins.GENERAL_PLUGINS_GROUP == ENTRY_POINT_GROUP
    assert BACKEND_NAME not in attention_registry.ATTENTION_BACKENDS
    # SGLang's loader, restricted to our plugin (SGLANG_PLUGINS is its own whitelist).
    monkeypatch.setenv("SGLANG_PLUGINS", ep.name)
    loaded = sglang_plugins.load_plugins_by_group(ENTRY_POINT_GROUP)
    assert ep.name in loaded, f"SGLang's loader did not load {ep.name}: {sorted(loaded)}"
    func, _dist = loaded[ep.name]
    assert func is plugin.register
    assert BACKEND_NAME not in attention_registry.ATTENTION_BACKENDS  # loading only imports
    # load_plugins() runs what it loads, once per process.
    monkeypatch.setattr(sglang_plugins, "_plugins_loaded", False)
    sglang_plugins.load_plugins()
    _assert_registered()


def test_register_direct_is_idempotent(unregistered):
    plugin.register()
    _assert_registered()
    plugin.register()
    _assert_registered()
    # Also with SGLang's lists already holding the name (e.g. a second module copy registered it).
    plugin._registered = False
    plugin.register()
    _assert_registered()


def _parse(*args):
    return sglang_server_args.prepare_server_args(["--model-path", "dummy", "--device", "cpu", *args])


def test_cli_accepts_registered_name():
    plugin.register()
    sa = _parse("--attention-backend", BACKEND_NAME, "--page-size", "64")
    assert sa.attention_backend == BACKEND_NAME and sa.page_size == 64
    sa = _parse("--decode-attention-backend", BACKEND_NAME, "--prefill-attention-backend", "triton")
    assert (sa.decode_attention_backend, sa.prefill_attention_backend) == (BACKEND_NAME, "triton")


def test_cli_rejects_unregistered_names(capsys):
    plugin.register()
    with pytest.raises(SystemExit):
        _parse("--attention-backend", BACKEND_NAME + "_not_registered")
    assert "invalid choice" in capsys.readouterr().err
    if hasattr(sglang_server_args, "DRAFT_ATTENTION_BACKEND_CHOICES"):
        # 0.5.23 keeps a separate draft list; our name is deliberately not in it (no draft support), so a
        # draft worker resolves to SGLang's own fallback instead of building tilelang_mla.
        assert BACKEND_NAME not in sglang_server_args.DRAFT_ATTENTION_BACKEND_CHOICES


@pytest.fixture
def published_server_args():
    """SGLang's process config for a tilelang_mla server (what the scheduler publishes at startup)."""
    plugin.register()
    runtime_context.publish(_parse("--attention-backend", BACKEND_NAME, "--page-size", "64"), role="scheduler")
    yield
    runtime_context.reset_context()


def _batch(mode, prefix_lens):
    bs = len(prefix_lens)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64)
    new = 1 if mode != ForwardMode.EXTEND else 5
    return ForwardBatch(forward_mode=mode, batch_size=bs, input_ids=torch.zeros(bs * new, dtype=torch.int64),
                        req_pool_indices=torch.arange(bs), seq_lens=prefix + new, seq_lens_cpu=prefix + new,
                        out_cache_loc=torch.zeros(bs * new, dtype=torch.int64), seq_lens_sum=int(prefix.sum()) + bs * new,
                        extend_prefix_lens_cpu=list(prefix_lens))


def test_deepseek_dispatch_for_our_name(published_server_args):
    handlers = importlib.import_module("sglang.srt.models.deepseek_common.attention_backend_handler")
    import sglang.srt.models.deepseek_v2  # noqa: F401  (the model code that calls the registry)

    assert plugin.register_deepseek_handler()
    assert handlers.AttentionBackendRegistry.get_handler(BACKEND_NAME) is plugin.deepseek_attention_handler
    method = handlers.AttnForwardMethod
    cases = [
        (ForwardMode.DECODE, [3, 70], method.MLA),
        (ForwardMode.TARGET_VERIFY, [3, 70], method.MLA),
        (ForwardMode.EXTEND, [0, 0], method.MHA),  # prefill, nothing cached: plain MHA (Triton backend)
        (ForwardMode.EXTEND, [64, 0], method.MLA),  # prefill over a cached prefix: absorbed MLA
    ]
    for mode, prefix, expected in cases:
        batch = _batch(mode, prefix)
        # The layer argument: these handlers read nothing from it on CUDA/CPU (only ROCm / AMX paths do).
        ours = plugin.deepseek_attention_handler(None, batch)
        assert ours == handlers.handle_attention_triton(None, batch) == expected, (mode, prefix, ours)


def test_prefill_backend_is_chosen_by_its_variable(monkeypatch):
    monkeypatch.setenv(plugin.ENV_PREFILL, "triton")
    assert plugin.prefill_backend() == "triton"
    monkeypatch.setenv(plugin.ENV_PREFILL, " FlashInfer ")
    assert plugin.prefill_backend() == "flashinfer"
    monkeypatch.setenv(plugin.ENV_PREFILL, "fa3")
    with pytest.raises(ValueError, match=f"^{BACKEND_NAME}: MLA_BACKEND_SGLANG_PREFILL='fa3' is not supported; "
                                         "use auto, flashinfer or triton$"):
        plugin.prefill_backend()
    monkeypatch.delenv(plugin.ENV_PREFILL)
    expected = "flashinfer" if importlib.util.find_spec("flashinfer") and torch.cuda.is_available() else "triton"
    assert plugin.prefill_backend() == expected


def test_register_turns_on_the_chunked_prefix_cache_for_a_flashinfer_prefill(unregistered, monkeypatch):
    # the list SGLang's model runner reads (0.5.17 defines it in server_args, 0.5.23 re-exports it there)
    chunked = sglang_server_args.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS
    original = list(chunked)
    try:
        chunked[:] = [name for name in original if name != BACKEND_NAME]
        monkeypatch.setenv(plugin.ENV_PREFILL, "triton")
        plugin.register()
        assert BACKEND_NAME not in chunked
        monkeypatch.setenv(plugin.ENV_PREFILL, "flashinfer")
        for _ in range(2):  # once, however often it registers
            plugin._registered = False
            plugin.register()
        assert chunked.count(BACKEND_NAME) == 1
    finally:
        chunked[:] = original


def test_deepseek_dispatch_follows_a_flashinfer_prefill(published_server_args, monkeypatch):
    import types

    handlers = importlib.import_module("sglang.srt.models.deepseek_common.attention_backend_handler")
    import sglang.srt.models.deepseek_v2  # noqa: F401

    monkeypatch.setattr(plugin, "_prefill_in_use", "flashinfer")
    method = handlers.AttnForwardMethod
    # The settings of a DeepSeek attention layer the FlashInfer handler reads (the layer's init sets them).
    layer = types.SimpleNamespace(flashinfer_mla_disable_ragged=False, disable_chunked_prefix_cache=False,
                                  chunked_prefix_cache_threshold=8, qk_rope_head_dim=64)
    for mode, prefix, allowed in [(ForwardMode.DECODE, [3, 70], {method.MLA}),
                                  (ForwardMode.TARGET_VERIFY, [3, 70], {method.MLA}),
                                  (ForwardMode.EXTEND, [0, 0], {method.MHA_ONE_SHOT, method.MHA_CHUNKED_KV}),
                                  (ForwardMode.EXTEND, [64, 0], {method.MHA_ONE_SHOT, method.MHA_CHUNKED_KV})]:
        batch = _batch(mode, prefix)
        ours = plugin.deepseek_attention_handler(layer, batch)
        assert ours == handlers.handle_attention_flashinfer(layer, batch) and ours in allowed, (mode, prefix, ours)


BASE_METHODS = ("init_forward_metadata", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph",
                "init_cuda_graph_state", "get_cuda_graph_seq_len_fill_value", "forward_decode", "forward_extend")


def test_backend_class_matches_sglang_base():
    from mla_backend.sglang_plugin.backend import TileLangMLABackend

    assert issubclass(TileLangMLABackend, AttentionBackend)
    for name in BASE_METHODS:
        assert name in TileLangMLABackend.__dict__, f"{name} is not overridden"
        base = inspect.signature(getattr(AttentionBackend, name))
        ours = inspect.signature(getattr(TileLangMLABackend, name))
        args = [p.name for p in base.parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        # Every argument SGLang may pass, positionally or by name, binds.
        ours.bind(*args)
        ours.bind(**{a: a for a in args})
        required = [p.name for p in ours.parameters.values()
                    if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        assert set(required) <= set(args), f"{name}: we require {required}, SGLang passes {args}"
    # The DeepSeek model passes the split absorbed query / key by name to the decode / extend calls.
    for name in ("forward_decode", "forward_extend"):
        inspect.signature(getattr(TileLangMLABackend, name)).bind(
            "self", "q", "k", "v", "layer", "forward_batch", save_kv_cache=True, q_rope=None, k_rope=None)


def test_page_table_kernel_found():
    from mla_backend.sglang_plugin.backend import _flashmla_kv_indices_kernel

    kernel, num_blocks = _flashmla_kv_indices_kernel()
    # backend.py launches it with these positional arguments, then PAGED_SIZE by name.
    assert list(kernel.arg_names[:8]) == [
        "req_to_token_ptr", "req_pool_indices_ptr", "page_kernel_lens_ptr", "kv_start_idx", "kv_indices_ptr",
        "req_to_token_ptr_stride", "kv_indices_ptr_stride", "PAGED_SIZE"], kernel.arg_names
    blocks = [num_blocks(width, 64) for width in (1, 64, 1024)]
    assert all(isinstance(b, int) and b >= 1 for b in blocks) and blocks == sorted(blocks)


# ---- construction through SGLang's MLA attention test kit (its model runner, real pools) ----

SHAPE = dict(kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=1024)


def _kit():
    try:
        from sglang.test.kits.attention_unittest.attention_methods import mla_attention
    except ImportError as exc:
        pytest.skip(f"this sglang build ships no MLA attention test kit: {exc}")
    return mla_attention


class _Case:
    """The kit calls ``testcase.skipTest`` when a backend cannot be built: make that a pytest failure."""

    def skipTest(self, reason):  # noqa: N802
        pytest.fail(f"SGLang's kit could not build the backend: {reason}")


def _build(page_size, heads=16, prefix=(5, 70)):
    kit = _kit()
    plugin.register()
    case = kit.MLAAttentionCase(name=f"cpu_p{page_size}_h{heads}", backend=BACKEND_NAME,
                                forward_mode=ForwardMode.DECODE, num_heads=heads, page_size=page_size,
                                prefix_lens=tuple(prefix), extend_lens=())
    return kit.build_mla_attention_fixture(_Case(), case, **SHAPE, max_context_len=128, dtype=torch.bfloat16,
                                           device="cpu")


@pytest.fixture
def kit_env(monkeypatch):
    # CPU: the PyTorch reference op (no TileLang kernel can run here); what a server would refuse without it.
    monkeypatch.setenv("MLA_BACKEND_IMPL", "reference")
    parallel = runtime_context.get_parallel()
    if hasattr(parallel, "override_permanently"):
        # 0.5.23: TritonAttnBackend reads attn_dcp_rank, which only a published server config sets; the
        # single-rank value, as SGLang's publish() states it when DCP is off.
        try:
            parallel.attn_dcp_rank
        except RuntimeError:
            parallel.override_permanently(attn_dcp_rank=0)
    yield


def test_refuses_unsupported_page_size(kit_env):
    with pytest.raises(ValueError, match=f"^{BACKEND_NAME}: --page-size 3 is not supported"):
        _build(page_size=3)


def test_refuses_too_many_heads(kit_env):
    with pytest.raises(ValueError, match=f"^{BACKEND_NAME}: 256 query heads per rank"):
        _build(page_size=64, heads=256)


def test_constructs_on_cpu_with_reference_impl(kit_env, monkeypatch, tmp_path):
    monkeypatch.setenv("MLA_BACKEND_SGLANG_REPORT", str(tmp_path))  # the backend's JSON report (e2e scripts read it)
    import logging

    core_logger = logging.getLogger("mla_backend")
    level = core_logger.level
    core_logger.setLevel(logging.NOTSET)  # as in a fresh server process
    try:
        fixture = _build(page_size=64)
        assert core_logger.isEnabledFor(logging.INFO)  # startup lines reach SGLang's log
    finally:
        core_logger.setLevel(level)
    backend = fixture.backend
    from mla_backend.sglang_plugin.backend import TileLangMLABackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert isinstance(backend, TileLangMLABackend), type(backend)
    assert backend.prefill_backend_name == "triton" and isinstance(backend.extend_backend, TritonAttnBackend)
    assert backend.config.impl == "reference" and backend.num_heads == 16 and backend.page_size == 64
    # SGLang's forward context reads the running backend's pools (DeepSeek's MHA prefill reads req_to_token_pool)
    from sglang.srt.model_executor import forward_context

    for accessor in ("get_req_to_token_pool", "get_token_to_kv_pool"):
        if hasattr(forward_context, accessor):
            monkeypatch.setattr(forward_context, "get_attn_backend", lambda: backend)
            assert getattr(forward_context, accessor)() is not None, accessor
    assert backend.req_to_token_pool.req_to_token is backend.req_to_token
    # The kit's runner holds SGLang's real pools: the cache the op reads is the pool's per-layer buffer.
    kv = backend.token_to_kv_pool.get_key_buffer(0)
    assert kv.shape[-1] == 576 and kv.view(-1, 64, 576).shape[0] >= 1
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)  # CPU: allowed (the refusal is CUDA-only)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    # decode metadata through the graph buffers (built before capture); its host time is accounted for the report
    backend.init_forward_metadata_out_graph(fixture.forward_batch, in_capture=True)
    md = backend.forward_metadata.metadata
    assert md.kv_lens.tolist() == [6, 71] and md.plan is not None  # prefixes 5 and 70 plus the decoded token
    (report,) = [json.loads(f.read_text()) for f in tmp_path.glob("*.json")]
    assert report["decode"] == 1 and report["impl"] == "reference" and report["metadata_host_us_per_call"] > 0


def test_flashinfer_prefill_asked_for_by_name_is_refused_where_it_cannot_be_built(kit_env, monkeypatch):
    """On CPU SGLang's FlashInfer MLA backend cannot be built: asked for by name, the backend refuses (naming the
    variable, its value and what is supported); chosen by default, it would prefill with Triton instead."""
    monkeypatch.setenv(plugin.ENV_PREFILL, "flashinfer")
    with pytest.raises(ValueError, match=f"^{BACKEND_NAME}: MLA_BACKEND_SGLANG_PREFILL=flashinfer, but SGLang's "
                                         "FlashInferMLAAttnBackend cannot be built .*supported: auto, flashinfer"):
        _build(page_size=64)


def test_serve_bench_reads_each_process_s_verification_report(kit_env, monkeypatch, tmp_path):
    """Under MLA_BACKEND_VERIFY=1 the backend's report carries the process's verification counters, and serve-bench
    --verify reads one report per process from what the backend wrote."""
    import mla_backend.verify
    from mla_backend.serve_bench.sglang_runner import read_verification

    monkeypatch.setenv("MLA_BACKEND_SGLANG_REPORT", str(tmp_path))
    monkeypatch.setattr(mla_backend.verify, "VERIFYING", True)
    for _ in range(2):  # two backend objects of one process (the target and the MTP draft's): one rank
        fixture = _build(page_size=64)
        fixture.backend.init_forward_metadata_out_graph(fixture.forward_batch)
    assert len(list(tmp_path.glob("*.json"))) == 2
    (rank,) = read_verification(str(tmp_path))
    # SGLang's ModelRunner has tp_rank; the kit's runner names none
    assert rank["pid"] == os.getpid() and rank["rank"] == getattr(fixture.backend.model_runner, "tp_rank", None)
    assert set(rank) >= {"calls", "max_rel_err", "max_lse_err", "calls_by_q_len"}


@pytest.mark.parametrize("env_value", [None, "1", "0"])
def test_graph_metadata_hooks(kit_env, monkeypatch, env_value):
    # Default (MLA_BACKEND_SGLANG_GRAPH_METADATA unset or 1): built eagerly before capture, recorded by the
    # in-graph hook, and a replay's out-of-graph call leaves the buffers to the graph. =0: rebuilt out of graph
    # before every replay, and the in-graph hook records nothing. (Routing only: CPU has no graphs.)
    if env_value is None:
        monkeypatch.delenv("MLA_BACKEND_SGLANG_GRAPH_METADATA", raising=False)
    else:
        monkeypatch.setenv("MLA_BACKEND_SGLANG_GRAPH_METADATA", env_value)
    graph_metadata = env_value != "0"
    fixture = _build(page_size=64)
    backend, fb = fixture.backend, fixture.forward_batch
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    kv_lens = backend.forward_metadata.metadata.kv_lens
    assert kv_lens.tolist() == [6, 71]
    fb.seq_lens.add_(1)  # the next step, written into the graph's input buffers before a replay
    backend.init_forward_metadata_in_graph(fb)  # inside capture
    assert kv_lens.tolist() == ([7, 72] if graph_metadata else [6, 71])
    fb.seq_lens.add_(1)
    backend.init_forward_metadata_out_graph(fb)  # before a replay
    assert kv_lens.tolist() == ([7, 72] if graph_metadata else [8, 73])
    assert backend.forward_metadata.metadata.kv_lens.data_ptr() == kv_lens.data_ptr()  # the graph's buffers


def test_graph_metadata_switch_other_than_0_or_1_is_refused(kit_env, monkeypatch):
    monkeypatch.setenv("MLA_BACKEND_SGLANG_GRAPH_METADATA", "yes")
    with pytest.raises(ValueError, match=f"^{BACKEND_NAME}: MLA_BACKEND_SGLANG_GRAPH_METADATA='yes' is not supported: "
                                         "1 records"):
        _build(page_size=64)


def test_fp8_compute_switch_other_than_0_or_1_is_refused(kit_env, monkeypatch):
    monkeypatch.setenv("MLA_BACKEND_FP8_COMPUTE", "on")
    with pytest.raises(ValueError, match=f"^{BACKEND_NAME}: MLA_BACKEND_FP8_COMPUTE='on' is not supported: 1 "):
        _build(page_size=64)
    monkeypatch.setenv("MLA_BACKEND_FP8_COMPUTE", "1")
    assert _build(page_size=64).backend.config.fp8_compute is False  # a bf16 pool: nothing to quantise


def test_graph_steps_reuse_one_metadata_per_batch_size_with_fresh_values(kit_env, monkeypatch):
    """Metadata out of graph: before each replay the graph buffers are refilled in place; the metadata over them is
    built at a batch size's first step only, and later steps read the same values as metadata built afresh."""
    monkeypatch.setenv("MLA_BACKEND_SGLANG_GRAPH_METADATA", "0")
    from mla_backend.planner import SplitPlanner
    from mla_backend.sglang_plugin.page_table import sglang_decode_metadata

    fixture = _build(page_size=16, prefix=(5, 40))
    backend, fb = fixture.backend, fixture.forward_batch
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    backend.init_forward_metadata_out_graph(fb)
    first = backend.forward_metadata
    plan = first.metadata.plan
    cu_blocks = plan.cu_blocks[:3].tolist()
    fb.seq_lens.add_(40)  # the next step: both requests grow by pages, the second by a 64-token block
    backend.init_forward_metadata_out_graph(fb)
    assert backend.forward_metadata is first and first.metadata.plan is plan
    fresh = sglang_decode_metadata(backend.req_to_token, fb.req_pool_indices, fb.seq_lens, 16)
    md = first.metadata
    assert md.kv_lens.tolist() == fresh.kv_lens.tolist() == [46, 81]
    for r, kv_len in enumerate(fresh.kv_lens.tolist()):
        pages = -(-kv_len // 16)
        ours = md.page_table[md.page_table_start[r]: md.page_table_start[r] + pages]
        theirs = fresh.page_table[fresh.page_table_start[r]: fresh.page_table_start[r] + pages]
        assert ours.tolist() == theirs.tolist(), r
    expected = SplitPlanner(4, backend.num_heads, 1, "cpu").plan(fresh.kv_lens)
    for name in ("cu_blocks", "part_begin_req", "part_end_req", "part_start", "req_parts"):
        got, want = getattr(plan, name), getattr(expected, name)
        n = {"cu_blocks": 3, "req_parts": 4}.get(name, want.shape[0])  # a batch of 2: its entries
        assert got[:n].tolist() == want[:n].tolist(), name
    assert plan.cu_blocks[:3].tolist() != cu_blocks  # the plan was made again, in place


@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_forward_matches_sglang_reference(kit_env, page_size):
    # The whole decode step on CPU: SGLang's MLA module writes the cache and calls RadixAttention, which calls our
    # forward_decode (each layer's launcher, the reference path here); the kit's dense reference attention agrees.
    kit = _kit()
    fixture = _build(page_size=page_size, prefix=(5, 70, 1))
    actual = kit.run_mla_fixture_eager(fixture)
    torch.testing.assert_close(actual, kit.expected_mla_fixture_output(fixture), atol=kit.MLA_ATOL, rtol=kit.MLA_RTOL)
    (launch,) = fixture.backend._launchers.values()  # one layer: one launcher, built at its first decode
    assert launch.num_heads == 16 and launch.page_size == page_size and launch.variant(1).is_reference


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

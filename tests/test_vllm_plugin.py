"""CPU tests of the vLLM plugin against the real vllm package, 0.26 .. 0.33 (no GPU, no mocks of vLLM).

What runs here: entry-point discovery through vLLM's own plugin loader, the registry, the capability
checks vLLM applies to an explicitly selected backend, vLLM's own decode/prefill split, and the
translation of vLLM's decode metadata into the canonical metadata, checked end to end through the
plugin's real ``forward_mqa`` (the op's reference path on CPU) against naive attention.
What needs a GPU (kernels, CUDA graphs, engines) is in tests/e2e/vllm_e2e.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (CI installs it with .ci/install_vllm.sh)")

from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.utils import split_decodes_and_prefills  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.worker.utils import select_common_block_size  # noqa: E402

from mla_backend import MLADecodeMetadata  # noqa: E402
from mla_backend.vllm_plugin import BACKEND_CLASS_PATH, PLUGIN_NAME, register  # noqa: E402
from mla_backend.vllm_plugin.translate import DecodeMetadataBuilder, decode_q_len_limit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GROUP = "vllm.general_plugins"
EP_VALUE = "mla_backend.vllm_plugin:register"
HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
TILELANG_REASON = "tilelang is not installed (pip install tilelang==0.1.9)"
SCALE = 192 ** -0.5  # DeepSeek: qk_head_dim ** -0.5, not 576 ** -0.5


def _backend():
    register()
    return AttentionBackendEnum.CUSTOM.get_class()


def _installed_entry_points():
    return [ep for ep in entry_points(group=GROUP) if ep.value == EP_VALUE]


def _run_python(code: str, extra_path: str | None = None, env: dict | None = None) -> str:
    """Runs ``code`` in a fresh interpreter (vLLM loads plugins once per process) and returns stdout."""
    run_env = {**os.environ, **(env or {})}
    paths = [str(REPO)] + ([extra_path] if extra_path else []) + [run_env.get("PYTHONPATH", "")]
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=run_env, timeout=300)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str | None:
    """None when the package is pip-installed with its entry point; else a directory holding a minimal
    ``.dist-info`` that declares the same entry point, so vLLM's loader can discover it either way."""
    if _installed_entry_points():
        return None
    root = tmp_path_factory.mktemp("plugin_site")
    info = root / "mla_backend_entry_point_only-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mla-backend-entry-point-only\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{PLUGIN_NAME} = {EP_VALUE}\n")
    return str(root)


# ---------------------------------------------------------------------------------------------- registration
def test_installed_package_declares_the_entry_point():
    try:
        distribution("mla_backend")
    except PackageNotFoundError:
        pytest.skip("mla_backend is not pip-installed (pip install -e . declares the entry point)")
    eps = _installed_entry_points()
    assert eps, f"mla_backend is installed but declares no [{GROUP}] entry point {PLUGIN_NAME} = \"{EP_VALUE}\""
    assert eps[0].name == PLUGIN_NAME


def test_vllm_plugin_loader_registers_custom(plugin_path):
    out = _run_python("""
        import json, sys
        import torch
        from vllm.plugins import load_general_plugins
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        load_general_plugins()
        custom = AttentionBackendEnum.CUSTOM
        cls = custom.get_class()
        print(json.dumps({"path": custom.get_path(), "cls": f"{cls.__module__}.{cls.__qualname__}",
                          "name": cls.get_name(), "cuda_init": torch.cuda.is_initialized()}))
    """, plugin_path)
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"path": BACKEND_CLASS_PATH, "cls": BACKEND_CLASS_PATH, "name": "CUSTOM", "cuda_init": False}


@pytest.mark.parametrize("allowed,registered", [(PLUGIN_NAME, True), ("some_other_plugin", False)])
def test_vllm_plugins_env_filters(plugin_path, allowed, registered):
    out = _run_python("""
        from vllm.plugins import load_general_plugins
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        load_general_plugins()
        print(AttentionBackendEnum.CUSTOM.is_overridden())
    """, plugin_path, env={"VLLM_PLUGINS": allowed})
    assert out.strip().splitlines()[-1] == str(registered)


def test_register_is_cheap_and_idempotent():
    out = _run_python("""
        import json, sys
        import vllm.plugins  # what vLLM has imported when it calls the entry point
        before = set(sys.modules)
        from mla_backend.vllm_plugin import register
        for _ in range(3):
            register()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, _ATTN_OVERRIDES
        import torch
        new = set(sys.modules) - before
        heavy = sorted(m for m in new if m.startswith(("tilelang", "tvm", "mla_backend.kernels.runtime",
                                                         "mla_backend.kernels.sm90", "mla_backend.kernels.combine",
                                                         "mla_backend.vllm_plugin.backend",
                                                         "vllm.model_executor")))
        print(json.dumps({"heavy": heavy, "path": AttentionBackendEnum.CUSTOM.get_path(),
                          "overrides": len(_ATTN_OVERRIDES), "cuda_init": torch.cuda.is_initialized()}))
    """)
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"heavy": [], "path": BACKEND_CLASS_PATH, "overrides": 1, "cuda_init": False}


def test_register_keeps_another_plugins_custom_backend():
    out = _run_python("""
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
        register_backend(AttentionBackendEnum.CUSTOM, "some.other.Backend")
        from mla_backend.vllm_plugin import register
        register()
        print(AttentionBackendEnum.CUSTOM.get_path())
    """)
    assert out.strip().splitlines()[-1] == "some.other.Backend"


def test_custom_resolves_to_backend_class():
    from mla_backend.vllm_plugin.backend import TileLangMLABackend

    cls = _backend()
    assert cls is TileLangMLABackend
    assert cls.get_name() == "CUSTOM"
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM  # vLLM maps names back this way
    assert cls.is_mla() and not cls.is_sparse()
    assert cls.get_impl_cls().__name__ == "TileLangMLAImpl"
    assert cls.get_builder_cls().__name__ == "TileLangMLAMetadataBuilder"


# ---------------------------------------------------------------------------------------------- capabilities
def test_declared_capabilities():
    cls = _backend()
    assert cls.get_supported_kernel_block_sizes() == [16, 32, 64, 128]
    assert cls.get_supported_head_sizes() == [576]
    assert set(cls.supported_dtypes) == {torch.float16, torch.bfloat16}
    assert set(cls.supported_kv_cache_dtypes) == {"auto", "float16", "bfloat16", "fp8", "fp8_e4m3"}
    assert cls.supports_compute_capability(DeviceCapability(9, 0))
    assert cls.supports_compute_capability(DeviceCapability(9, 4))  # MI300X on vLLM's ROCm platform
    for major, minor in ((8, 0), (8, 9), (9, 5), (10, 0), (12, 0)):
        assert not cls.supports_compute_capability(DeviceCapability(major, minor))
    # vLLM's default block size (16) stays 16; a larger block is split into kernel blocks.
    assert cls.get_preferred_block_size(16) == 16
    for manager_block, kernel_block in ((16, 16), (32, 32), (64, 64), (128, 128), (256, 128), (512, 128)):
        assert cls.supports_block_size(manager_block)
        assert select_common_block_size(manager_block, [cls]) == kernel_block
    assert not cls.supports_block_size(8)


def _validate(cls, capability=(9, 0), **overrides):
    """The call CudaPlatform.get_attn_backend_cls makes for an explicitly selected backend."""
    fields = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=True)
    fields.update(overrides)
    config = AttentionSelectorConfig(**fields)
    return cls.validate_configuration(device_capability=DeviceCapability(*capability), **config._asdict())


def _strip_tilelang(reasons: list[str]) -> list[str]:
    """The environment's tilelang availability is checked by the backend too; keep the other reasons."""
    out = []
    for reason in reasons:
        parts = [p for p in reason.split("; ") if p != TILELANG_REASON]
        if parts:
            out.append("; ".join(parts))
    return out


@pytest.mark.parametrize("block_size", [None, 16, 64, 128, 256])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8", "fp8_e4m3"])
def test_validate_configuration_accepts(block_size, kv_cache_dtype):
    cls = _backend()
    reasons = _validate(cls, block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    assert _strip_tilelang(reasons) == []
    if HAS_TILELANG:
        assert reasons == []
    else:
        assert any(TILELANG_REASON in r for r in reasons)


def test_validate_configuration_fp16():
    assert _strip_tilelang(_validate(_backend(), dtype=torch.float16, kv_cache_dtype="float16", block_size=64)) == []


@pytest.mark.parametrize("overrides,expected", [
    (dict(head_size=512), "head_size not supported"),
    (dict(dtype=torch.float32), "dtype not supported"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype not supported"),
    (dict(kv_cache_dtype="fp8_ds_mla"), "kv_cache_dtype not supported"),
    (dict(block_size=8), "block_size not supported"),
    (dict(use_mla=False), "non-MLA not supported"),
    (dict(use_sparse=True), "sparse not supported"),
    (dict(has_sink=True), "attention sinks not supported"),
    (dict(use_pcp=True), "PCP not supported"),
    (dict(kv_cache_dtype="float16"), "kv_cache_dtype float16 with model dtype torch.bfloat16"),
])
def test_validate_configuration_refuses(overrides, expected):
    reasons = _validate(_backend(), **overrides)
    assert any(expected in r for r in reasons), reasons


@pytest.mark.parametrize("capability", [(8, 0), (10, 0)])
def test_validate_configuration_refuses_other_gpus(capability):
    assert "compute capability not supported" in _validate(_backend(), capability)


def test_validate_configuration_refuses_adaptive_verification():
    """vLLM >= 0.33: adaptive verification trims query lengths on the device only; the decode path plans
    from the host query lengths, so the backend opts out (supports_device_cpu_query_lens_mismatch)."""
    if "use_adaptive_verification" not in AttentionSelectorConfig._fields:
        pytest.skip("this vLLM has no adaptive verification (added in 0.28)")
    assert "use_adaptive_verification" in AttentionSelectorConfig._fields
    reasons = _validate(_backend(), use_adaptive_verification=True)
    assert any("device-cpu query lens mismatch not supported" in r for r in reasons), reasons
    assert _strip_tilelang(_validate(_backend(), use_adaptive_verification=False)) == []


def test_kv_cache_layouts_give_dense_layer_pages():
    """vLLM >= 0.33 resolves one physical KV layout per model; each layout the backend accepts must give
    every layer dense [num_pages, page_size, 576] pages (what the kernels index), computed with vLLM's
    own stride code, and vLLM's resolution over this backend must offer exactly those layouts."""
    layout_mod = pytest.importorskip("vllm.v1.kv_cache_layout", reason="no KV-cache layout API (added in 0.29)")
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, compute_layout_strides

    cls = _backend()
    declared = cls.supported_kv_cache_layouts()
    assert declared and get_supported_kv_cache_layouts([cls]) == list(declared)
    for kv_dtype, cache_dtype_str in ((torch.bfloat16, "auto"), (torch.float8_e4m3fn, "fp8")):
        spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=kv_dtype,
                                cache_dtype_str=cache_dtype_str)
        page_bytes = 64 * 576 * kv_dtype.itemsize
        for layout in layout_mod.KVCacheLayout:
            _, block_stride, _, token_stride, _ = compute_layout_strides(spec, 10, 3, layout)
            dense = block_stride == page_bytes and token_stride == 576 * kv_dtype.itemsize
            if layout in declared:
                assert dense, (layout, block_stride, page_bytes)
            elif layout.name.startswith("BL"):
                assert not dense, layout  # layers interleaved inside a block: why these are left out


def test_rocm_needs_the_gfx942_opt_in(monkeypatch):
    """On vLLM's ROCm platform the backend is refused with the opt-in named, and accepted once opted in."""
    from vllm.platforms import current_platform

    monkeypatch.delenv("MLA_BACKEND_IMPL", raising=False)
    monkeypatch.delenv("MLA_BACKEND_SGLANG_IMPL", raising=False)
    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: True)
    reasons = _validate(_backend(), capability=(9, 4))
    assert any("set MLA_BACKEND_IMPL=tilelang-gfx942" in r for r in reasons), reasons
    monkeypatch.setenv("MLA_BACKEND_IMPL", "tilelang-gfx942")
    assert _strip_tilelang(_validate(_backend(), capability=(9, 4))) == []
    monkeypatch.setenv("MLA_BACKEND_IMPL", "fastest")
    assert any("MLA_BACKEND_IMPL='fastest' is not supported" in r for r in _validate(_backend(), capability=(9, 4)))


def test_cudagraph_and_query_len_support():
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport

    builder = _backend().get_builder_cls()
    assert builder._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert builder.query_len_support == QueryLenSupport.UNIFORM
    assert builder.reorder_batch_threshold == 1  # vLLM raises it to 1 + num_speculative_tokens
    impl = _backend().get_impl_cls()
    assert impl.can_return_lse_for_decode and impl.lse_base_on_e and not impl.supports_pcp


def test_decode_q_len_limit():
    assert decode_q_len_limit(None) == 1
    assert decode_q_len_limit(0) == 1
    assert decode_q_len_limit(1) == 2
    assert decode_q_len_limit(3) == 4
    assert decode_q_len_limit(2, parallel_drafting=True) == 5


# ---------------------------------------------------------------------------------------------- engine configs
TINY_CONFIG = REPO / "tests" / "e2e" / "tiny_dsv3" / "config.json"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_dsv3")
    (d / "config.json").write_text(TINY_CONFIG.read_text())
    return d


def _parallel(tp: int = 1, dcp: int = 1):
    from vllm.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)


def _vllm_config(model_dir, hf_overrides=None, speculative_tokens=None, tp=1, dcp=1, draft_backend=None):
    from vllm.config import DeviceConfig, ModelConfig, SpeculativeConfig, VllmConfig

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
                        hf_overrides=hf_overrides or {})
    spec = None
    if speculative_tokens:
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=speculative_tokens, target_model_config=model,
                                 target_parallel_config=_parallel(tp, dcp), attention_backend=draft_backend)
    return VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"), speculative_config=spec,
                      parallel_config=_parallel(tp, dcp))


def test_tiny_config_is_deepseek_v3_mla(model_dir):
    cfg = _vllm_config(model_dir)
    assert cfg.model_config.use_mla and cfg.model_config.get_head_size() == 576
    assert cfg.model_config.architectures == ["DeepseekV3ForCausalLM"]


@pytest.mark.parametrize("overrides,spec_tokens,tp,dcp,expected", [
    ({}, None, 1, 1, None),
    ({}, 1, 1, 1, None),
    ({}, 3, 1, 1, None),
    ({}, 4, 1, 1, "decode query length 5"),
    ({"num_attention_heads": 256, "num_key_value_heads": 256}, None, 1, 1, "256 query heads per GPU"),
    ({}, 1, 2, 2, None),  # DCP: q_len 1 here (vLLM sends MTP rows to its prefill path), 8 x 2 heads per call
    ({}, 4, 2, 2, None),
    ({"num_attention_heads": 256, "num_key_value_heads": 256}, None, 2, 2,
     "256 query heads per GPU x decode context parallel size 2"),
])
def test_supports_combination_reads_engine_config(model_dir, overrides, spec_tokens, tp, dcp, expected):
    from vllm.config import set_current_vllm_config

    cfg = _vllm_config(model_dir, overrides, spec_tokens, tp, dcp)
    with set_current_vllm_config(cfg):
        reasons = _strip_tilelang(_validate(_backend(), block_size=64))
    if expected is None:
        assert reasons == []
    else:
        assert any(expected in r for r in reasons), reasons


def test_draft_backend_hint_names_the_speculative_config_setting(model_dir):
    """vLLM's MTP drafter picks its own attention backend unless the speculative config names one: the builder tells
    the user how to put it on CUSTOM, and says nothing where it is named or there is no drafter."""
    from mla_backend.vllm_plugin.backend import draft_backend_hint

    assert draft_backend_hint(_vllm_config(model_dir).speculative_config) is None
    hint = draft_backend_hint(_vllm_config(model_dir, speculative_tokens=1).speculative_config)
    assert hint is not None and '"attention_backend": "CUSTOM"' in hint and "--speculative-config" in hint
    named = _vllm_config(model_dir, speculative_tokens=1, draft_backend="CUSTOM").speculative_config
    assert named.attention_backend.name == "CUSTOM" and draft_backend_hint(named) is None


# ---------------------------------------------------------------------------------------------- translation
def _paged_batch(seq_lens, q_len, page_size, num_pad, max_batch, max_blocks, kv_dtype, gen):
    """A vLLM-like step: a persistent block table [max_batch, max_blocks] whose first rows hold randomly
    permuted pages (page 0 is vLLM's null block), padded rows pointing at page 0 with seq_len 0."""
    num_pages_each = [-(-s // page_size) for s in seq_lens]
    num_pages = 1 + sum(num_pages_each) + 3
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).to(torch.int32)
    block_table = torch.zeros(max_batch, max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(num_pages_each):
        block_table[r, :n] = perm[used:used + n]
        used += n
    cache = torch.randn(num_pages, page_size, 576, generator=gen) * 0.5
    cache = cache.to(kv_dtype)
    batch = len(seq_lens) + num_pad
    seq = torch.zeros(max_batch, dtype=torch.int32)
    seq[: len(seq_lens)] = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.zeros(max_batch + 1, dtype=torch.int32)
    qsl[1: len(seq_lens) + 1] = torch.arange(1, len(seq_lens) + 1, dtype=torch.int32) * q_len
    qsl[len(seq_lens) + 1:] = len(seq_lens) * q_len
    return block_table, seq, qsl, cache, batch


def _naive_attention(q_nope, q_pe, cache, block_table, seq_lens, q_len, k_scale):
    """Unpaged softmax attention in float64, causal inside each request's q_len new tokens."""
    num_tokens, heads, _ = q_nope.shape
    out = torch.zeros(num_tokens, heads, 512, dtype=torch.float64)
    page_size = cache.shape[1]
    for r, kv_len in enumerate(seq_lens.tolist()):
        if kv_len == 0:
            continue
        pages = block_table[r, : -(-kv_len // page_size)].long()
        kv = cache[pages].reshape(-1, 576)[:kv_len].double() * k_scale
        for i in range(q_len):
            t = r * q_len + i
            visible = kv_len - q_len + i + 1
            q = torch.cat([q_nope[t], q_pe[t]], dim=-1).double()  # [H, 576]
            p = torch.softmax(q @ kv[:visible].T * SCALE, dim=-1)
            out[t] = p @ kv[:visible, :512]
    return out


def _impl(kv_cache_dtype: str, num_heads: int):
    from vllm.config import DeviceConfig, VllmConfig

    return _impl_in(VllmConfig(device_config=DeviceConfig(device="cpu")), kv_cache_dtype, num_heads)


def _impl_in(vllm_config, kv_cache_dtype: str, num_heads: int):
    from vllm.config import set_current_vllm_config

    impl_cls = _backend().get_impl_cls()
    with set_current_vllm_config(vllm_config):
        return impl_cls(num_heads=num_heads, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
                        sliding_window=None, kv_cache_dtype=kv_cache_dtype, logits_soft_cap=None, attn_type="decoder",
                        kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, kv_b_proj=None)


class _Layer:
    """The two attributes forward_mqa reads from vLLM's MLAAttention layer (fp32 0-d scales)."""

    def __init__(self, k_scale: float):
        self._k_scale = torch.tensor(k_scale, dtype=torch.float32)
        self._q_scale = torch.tensor(1.0, dtype=torch.float32)


def _decode_metadata(heads, page_size, q_lens, block_table, seq_lens, qsl, batch, q_len, max_seq_len):
    """What MLACommonMetadataBuilder.build hands forward_mqa for an all-decode batch: our _build_decode's metadata in
    vLLM's MLA metadata (the decode rows' slices of the persistent block table, lengths and query offsets)."""
    from mla_backend.vllm_plugin.backend import TileLangMLADecodeMetadata, TileLangMLAMetadata

    num_tokens = batch * q_len
    mla = DecodeMetadataBuilder(block_table.shape[0], heads, page_size, q_lens, "cpu").build(
        block_table[:batch], seq_lens[:batch], qsl[: batch + 1], num_tokens, max_seq_len)
    return TileLangMLAMetadata(
        num_reqs=batch, max_query_len=q_len, max_seq_len=max_seq_len, num_actual_tokens=num_tokens,
        query_start_loc=qsl[: batch + 1], slot_mapping=torch.zeros(num_tokens, dtype=torch.int64), num_decodes=batch,
        num_decode_tokens=num_tokens, num_prefills=0, head_dim=576,
        decode=TileLangMLADecodeMetadata(block_table=block_table[:batch], seq_lens=seq_lens[:batch],
                                         dcp_tot_seq_lens=None, mla=mla))


@pytest.mark.parametrize("q_len,page_size,kv_cache_dtype,num_pad", [
    (1, 16, "auto", 0),
    (1, 64, "auto", 3),
    (2, 16, "auto", 2),  # MTP with 1 draft, padded CUDA-graph batch
    (4, 32, "auto", 0),
    (1, 64, "fp8", 1),
    (2, 128, "fp8_e4m3", 0),
])
def test_forward_mqa_matches_naive_attention(q_len, page_size, kv_cache_dtype, num_pad):
    gen = torch.Generator().manual_seed(q_len * 1000 + page_size)
    heads, max_batch, max_blocks = 16, 8, 40
    seq_lens = [q_len, 7 + q_len, page_size + 1, 3 * page_size, 200 + q_len][: max_batch - num_pad]
    fp8 = kv_cache_dtype.startswith("fp8")
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k_scale = 0.75 if fp8 else 1.0
    block_table, seq_all, qsl_all, cache, batch = _paged_batch(seq_lens, q_len, page_size, num_pad, max_batch,
                                                               max_blocks, kv_dtype, gen)
    num_decode_tokens = batch * q_len
    # vLLM's own split of this (all-decode, possibly padded) batch, then the slices MLACommonMetadataBuilder.build
    # hands to _build_decode.
    common = CommonAttentionMetadata(
        query_start_loc=qsl_all[: batch + 1], query_start_loc_cpu=qsl_all[: batch + 1], seq_lens=seq_all[:batch],
        num_reqs=batch, num_actual_tokens=num_decode_tokens, max_query_len=q_len, max_seq_len=max(seq_lens),
        block_table_tensor=block_table[:batch], slot_mapping=torch.zeros(num_decode_tokens, dtype=torch.int64))
    threshold = decode_q_len_limit(q_len - 1)
    num_decodes, num_prefills, n_dec_tokens, _ = split_decodes_and_prefills(common, decode_threshold=threshold,
                                                                            require_uniform=True)
    assert (num_decodes, num_prefills, n_dec_tokens) == (batch, 0, num_decode_tokens)

    metadata = _decode_metadata(heads, page_size, range(1, threshold + 1), block_table, seq_all, qsl_all, batch,
                                q_len, max(seq_lens))
    assert metadata.decode.mla.q_len == q_len and metadata.decode.mla.page_table.data_ptr() == block_table.data_ptr()

    # q as MLAAttention.forward_impl hands it over: (ql_nope, q_pe), both non-contiguous views.
    ql_nope = torch.randn(heads, num_decode_tokens, 512, generator=gen).to(torch.bfloat16).transpose(0, 1)
    q_pe = torch.randn(num_decode_tokens, heads, 192, generator=gen).to(torch.bfloat16)[..., 128:]
    impl = _impl(kv_cache_dtype, heads)
    assert impl.supports_quant_query_input is False  # q stays bf16 with an fp8 cache
    out, lse = impl.forward_mqa((ql_nope, q_pe), cache, metadata, _Layer(k_scale))
    assert lse is None and out.shape == (num_decode_tokens, heads, 512) and out.dtype == torch.bfloat16

    want = _naive_attention(ql_nope, q_pe, cache, block_table, seq_all[:batch], q_len, k_scale)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    if num_pad:  # CUDA-graph padding rows see no KV: zeros
        assert out[len(seq_lens) * q_len:].abs().max().item() == 0.0


@pytest.mark.parametrize("env,kv_cache_dtype,want",
                         [(None, "fp8", True), ("0", "fp8_e4m3", False), (None, "auto", False)])
def test_fp8_compute_is_the_default_with_an_fp8_cache(env, kv_cache_dtype, want, monkeypatch):
    monkeypatch.delenv("MLA_BACKEND_FP8_COMPUTE", raising=False)
    if env is not None:
        monkeypatch.setenv("MLA_BACKEND_FP8_COMPUTE", env)
    assert _impl(kv_cache_dtype, 128)._fp8_compute is want


@pytest.mark.parametrize("dcp,page_size", [(2, 16), (4, 64)])
def test_decode_context_parallel_shards_merge_by_the_returned_lse(dcp, page_size):
    """Under DCP each rank holds every dcp-th token of a request (vLLM's interleave size 1) in its own pages and
    attends all of the group's heads over them, returning the natural-log LSE; merged by that LSE as vLLM's DCP
    combine does, the ranks' outputs equal attention over the whole sequence, ranks that hold no token of a request
    included (zeros, LSE -inf)."""
    gen = torch.Generator().manual_seed(dcp * 100 + page_size)
    heads, max_batch, max_blocks = 32, 8, 40  # 16 heads per GPU x DCP 2, or 8 x 4
    seq_lens = [1, dcp + 1, page_size + 1, 3 * page_size - 1, 5 * page_size + 3]
    full_table, full_seq, qsl, full_cache, batch = _paged_batch(seq_lens, 1, page_size, 0, max_batch, max_blocks,
                                                                torch.bfloat16, gen)
    ql_nope = torch.randn(heads, batch, 512, generator=gen).to(torch.bfloat16).transpose(0, 1)
    q_pe = torch.randn(batch, heads, 192, generator=gen).to(torch.bfloat16)[..., 128:]
    want = _naive_attention(ql_nope, q_pe, full_cache, full_table, full_seq[:batch], 1, 1.0)
    impl = _impl("auto", heads)
    impl.need_to_return_lse_for_decode = True  # what vLLM sets on every rank of a DCP group
    outs, lses = [], []
    for rank in range(dcp):
        local_lens = [len(range(rank, n, dcp)) for n in seq_lens]
        table, seq, local_qsl, cache, _ = _paged_batch(local_lens, 1, page_size, 0, max_batch, max_blocks,
                                                       torch.bfloat16, gen)
        for r, n in enumerate(seq_lens):  # this rank's tokens of request r, into its own (randomly placed) pages
            rows = full_cache[full_table[r, : -(-n // page_size)].long()].reshape(-1, 576)[:n][rank::dcp]
            pages = table[r, : -(-len(rows) // page_size)].long()
            local = cache[pages].reshape(-1, 576)
            local[: len(rows)] = rows
            cache[pages] = local.view(-1, page_size, 576)
        metadata = _decode_metadata(heads, page_size, (1,), table, seq, local_qsl, batch, 1, max(local_lens))
        out, lse = impl.forward_mqa((ql_nope, q_pe), cache, metadata, _Layer(1.0))
        assert out.shape == (batch, heads, 512) and lse.shape == (batch, heads) and lse.dtype == torch.float32
        outs.append(out.double())
        lses.append(lse.double())
    lse = torch.stack(lses)  # [dcp, tokens, heads]
    assert torch.isneginf(lse[1:, 0]).all() and outs[1][0].abs().max() == 0  # request 0's one token is on rank 0
    weights = torch.exp(lse - lse.max(dim=0).values)
    merged = (weights.unsqueeze(-1) * torch.stack(outs)).sum(0) / weights.sum(0).unsqueeze(-1)
    torch.testing.assert_close(merged, want, atol=2e-2, rtol=2e-2)


def test_translation_matches_core_from_block_table():
    gen = torch.Generator().manual_seed(7)
    block_table, seq_all, qsl_all, _, batch = _paged_batch([5, 70, 130], 2, 64, 1, 8, 6, torch.bfloat16, gen)
    builder = DecodeMetadataBuilder(8, 16, 64, (1, 2), "cpu")
    got = builder.build(block_table[:batch], seq_all[:batch], qsl_all[: batch + 1], batch * 2)
    want = MLADecodeMetadata.from_block_table(block_table[:batch], seq_all[:batch], page_size=64, q_len=2)
    for name in ("kv_lens", "qo_indptr", "page_table", "page_table_start"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.page_size, got.q_len) == (want.page_size, want.q_len)


@pytest.mark.parametrize("bad", [dict(sliding_window=128), dict(logits_soft_cap=30.0), dict(num_heads=256),
                                 dict(kv_cache_dtype="fp8_e5m2"), dict(alibi_slopes=[1.0])])
def test_impl_refuses_unsupported_features(bad):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    kwargs = dict(num_heads=16, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
                  kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
                  q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192,
                  v_head_dim=128, kv_b_proj=None)
    kwargs.update(bad)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        with pytest.raises(NotImplementedError, match="does not support"):
            _backend().get_impl_cls()(**kwargs)


def test_warm_up_is_a_no_op_off_gpu():
    from mla_backend.vllm_plugin.backend import warm_up_kernels

    assert warm_up_kernels(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 16, 64, (1, 2)) == []


# ---------------------------------------------------------------------------------------------- the real builder
class _PrefillStandIn:
    """Stands in for the layer's MLA prefill backend, which vLLM's builder clones in __init__ and hands
    prefill metadata to; vLLM's flash-attention prefill backend cannot be imported without a GPU."""

    @staticmethod
    def get_name() -> str:  # vLLM >= 0.33's build() checks for its TRTLLM_RAGGED prefill by name
        return "PREFILL_STAND_IN"

    def clone(self):
        return self

    def prepare_metadata(self, metadata):
        self.metadata = metadata


class _LayerStandIn:
    """The attributes vLLM's MLA builder reads from the layer in static_forward_context: the prefill
    backend, and (vLLM >= 0.33, which allows per-group latent sizes) the MLA dimensions."""

    def __init__(self, model_dir):
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        self.prefill_backend = _PrefillStandIn()
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            setattr(self, name, hf[name])


LAYER = "model.layers.0.self_attn.attn"


def _builder(model_dir, num_spec=None, block_size=64, max_num_seqs=8, kv_cache_dtype="auto", tp=1, dcp=1):
    """vLLM's MLACommonMetadataBuilder machinery with our subclass, constructed on CPU as the model runner
    does (kernel-size MLAAttentionSpec, layer names, VllmConfig, device)."""
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig, set_current_vllm_config)
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    spec = None
    if num_spec:
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=num_spec, target_model_config=model,
                                 target_parallel_config=_parallel(tp, dcp))
    cfg = VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"), speculative_config=spec,
                     parallel_config=_parallel(tp, dcp),
                     cache_config=CacheConfig(block_size=block_size, cache_dtype=kv_cache_dtype),
                     scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=4096,
                                                      is_encoder_decoder=False))
    cfg.compilation_config.static_forward_context[LAYER] = _LayerStandIn(model_dir)
    kv_spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                               cache_dtype_str=kv_cache_dtype)
    with set_current_vllm_config(cfg):
        return _backend().get_builder_cls()(kv_spec, [LAYER], cfg, torch.device("cpu")), cfg


@pytest.mark.parametrize("num_spec,threshold", [(None, 1), (1, 2), (3, 4)])
def test_builder_reorder_threshold_follows_speculation(model_dir, num_spec, threshold):
    builder, _ = _builder(model_dir, num_spec)
    assert builder.reorder_batch_threshold == threshold
    assert builder._decode.q_lens == tuple(range(1, threshold + 1))
    assert builder.page_size == 64 and builder.num_heads == 16


def test_builder_under_decode_context_parallelism_plans_the_group_s_heads_for_one_query(model_dir):
    """DCP 2 at TP 2: vLLM all-gathers q over the DCP group, so each call has 8 x 2 heads, and keeps MTP rows out of
    the decode path (this backend does not declare DCP with several queries): one query per request."""
    builder, cfg = _builder(model_dir, num_spec=1, tp=2, dcp=2)
    assert builder.num_heads == 8 and builder._decode.num_heads == 16
    assert builder.reorder_batch_threshold == 1 and builder._decode.q_lens == (1,)
    assert _impl_in(cfg, "auto", 8)._q_lens == (1,)


def test_builder_refuses_too_many_drafts(model_dir):
    with pytest.raises(ValueError, match="decode query length"):
        _builder(model_dir, num_spec=4)


def test_real_build_splits_decodes_and_prefills(model_dir, monkeypatch):
    """vLLM's build(): MTP rows (q_len 2) first go to our _build_decode, the 5-token prefill to vLLM's prefill."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import mla_attention

    # vLLM >= 0.33's prefill path allocates pinned host tensors (PIN_MEMORY, fixed at import); with no GPU
    # vLLM's "unspecified" platform still claims pinned memory, which a CPU-only torch cannot allocate.
    monkeypatch.setattr(mla_attention, "PIN_MEMORY", False, raising=False)
    builder, cfg = _builder(model_dir, num_spec=1)
    qsl = torch.tensor([0, 2, 4, 6, 11], dtype=torch.int32)
    seq = torch.tensor([10, 70, 130, 5], dtype=torch.int32)
    table = torch.zeros(8, 10, dtype=torch.int32)
    table[:4, :3] = torch.arange(1, 13, dtype=torch.int32).view(4, 3)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=4, num_actual_tokens=11,
        max_query_len=5, max_seq_len=130, block_table_tensor=table[:4], slot_mapping=torch.zeros(11, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq)  # vLLM 0.33 removed the deprecated _seq_lens_cpu fields
    with set_current_vllm_config(cfg):
        md = builder.build(0, common)
    assert type(md).__name__ == "TileLangMLAMetadata"
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (3, 6, 1)
    mla = md.decode.mla
    assert mla.q_len == 2 and mla.page_size == 64
    assert mla.qo_indptr.tolist() == [0, 2, 4, 6] and mla.kv_lens.tolist() == [10, 70, 130]
    assert mla.page_table_start.tolist() == [0, 10, 20]
    assert mla.page_table.data_ptr() == table.data_ptr() and mla.plan is not None
    assert md.prefill is not None and md.prefill.block_table.shape[0] == 1


def test_real_build_for_cudagraph_capture_padded_batch(model_dir):
    """A FULL-graph capture/replay batch: 2 real MTP rows padded to 4 with empty rows (vLLM's padding)."""
    from vllm.config import set_current_vllm_config

    builder, cfg = _builder(model_dir, num_spec=1)
    qsl = torch.tensor([0, 2, 4, 4, 4], dtype=torch.int32)
    seq = torch.tensor([33, 64, 0, 0], dtype=torch.int32)
    table = torch.zeros(8, 4, dtype=torch.int32)
    table[:2, :1] = torch.tensor([[5], [6]], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=4, num_actual_tokens=8, max_query_len=2,
        max_seq_len=4096, block_table_tensor=table[:4], slot_mapping=torch.zeros(8, dtype=torch.int64))
    with set_current_vllm_config(cfg):
        first = builder.build_for_cudagraph_capture(common)
        seq[:2] = torch.tensor([34, 65], dtype=torch.int32)
        again = builder.build(0, common)  # a replay step: new lengths, same storage
    assert (first.num_decodes, first.num_decode_tokens, first.num_prefills) == (4, 8, 0)
    for name in ("kv_lens", "qo_indptr", "page_table", "page_table_start"):
        assert getattr(first.decode.mla, name).data_ptr() == getattr(again.decode.mla, name).data_ptr(), name
    assert first.decode.mla.plan.cu_blocks.data_ptr() == again.decode.mla.plan.cu_blocks.data_ptr()
    assert again.decode.mla.kv_lens.tolist() == [34, 65, 0, 0]


def test_the_step_s_first_decode_call_makes_the_plan(model_dir, monkeypatch):
    """_build_decode launches nothing: the step's first forward_mqa makes the split plan (inside a full graph's
    capture, so a replay step's build is host work only), once for every layer; the output is the reference's."""
    from vllm.config import set_current_vllm_config

    gen = torch.Generator().manual_seed(5)
    builder, cfg = _builder(model_dir)
    table, seq, qsl, cache, batch = _paged_batch([1, 70, 300], 1, 64, 0, 8, 10, torch.bfloat16, gen)
    common = CommonAttentionMetadata(
        query_start_loc=qsl[: batch + 1], query_start_loc_cpu=qsl[: batch + 1], seq_lens=seq[:batch], num_reqs=batch,
        num_actual_tokens=batch, max_query_len=1, max_seq_len=300, block_table_tensor=table[:batch],
        slot_mapping=torch.zeros(batch, dtype=torch.int64))
    with set_current_vllm_config(cfg):
        md = builder.build(0, common)
    planner = md.decode.planner
    assert planner is builder._decode.planner(1) and md.decode.mla.plan is planner.buffers
    md.decode.mla.plan.cu_blocks[1:].fill_(-1)  # nothing planned yet (entry 0 stays 0)
    plans = []
    monkeypatch.setattr(planner, "plan", lambda kv_lens, run=planner.plan: plans.append(1) or run(kv_lens))
    ql_nope = torch.randn(batch, 16, 512, generator=gen).to(torch.bfloat16)
    q_pe = torch.randn(batch, 16, 64, generator=gen).to(torch.bfloat16)
    impl = _impl("auto", 16)
    outs = [impl.forward_mqa((ql_nope, q_pe), cache, md, _Layer(1.0))[0] for _layer in range(3)]
    assert len(plans) == 1 and md.decode.planner is None
    assert md.decode.mla.plan.cu_blocks[: batch + 1].tolist() == [0, 1, 3, 8]  # 64-token blocks per request
    want = _naive_attention(ql_nope, q_pe, cache, table, seq[:batch], 1, 1.0)
    for out in outs:
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)

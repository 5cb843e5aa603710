"""``MLADecodeLauncher``: the decode op prepared once per layer shape, for an engine's hot path.

:func:`~mla_backend.mla_decode` checks its arguments on every call, then launches. An engine calls one shape per
layer over and over (vLLM runs attention eagerly, once per layer, in every step its piecewise CUDA graphs serve), so a
launcher makes the implementation choice, the checks, the kernel lookup (or compile) and the scalar kernel arguments
once, when it is built. A call picks the prepared variant by ``metadata.q_len`` (a list index), reads
``metadata.plan`` and launches the split and combine kernels through TileLang's tvm-ffi entries
(``kernels.runtime.launch_entry``).

A *variant* is the implementation of one ``(device, num_heads, q_len, page_size, dtype, kv_dtype, impl, fp8_compute)``:
the TileLang kernels (:class:`KernelVariant`) or the fp32 PyTorch reference (:class:`ReferenceVariant`), cached per
process by :func:`prepare_variant`. Its ``run`` is the one launch path of the package: ``mla_decode`` calls it after its
checks, a launcher calls it directly.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from . import verify
from .constants import KV_LORA_RANK, MAX_Q_LEN
from .dispatch import REFERENCE, log_choice, select_impl
from .kernels.configs import config_for, fp8_compute_applies
from .metadata import MLAInputError, check_page_size, check_q_len
from .reference import mla_decode_reference
from .validation import FP8_DTYPES, KV_DTYPES, Q_DTYPES, check_scales, fail

__all__ = ["KernelVariant", "MLADecodeLauncher", "ReferenceVariant", "Scales", "checked_fp8_compute", "checked_k_scale",
           "kernel_scales", "prepare_variant"]


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------- scales
class Scales(NamedTuple):
    """A call's scales: as given (the reference's) and as the fp32 ``[1]`` device tensors the kernels read."""

    softmax_scale: float
    k_scale: float | torch.Tensor | None  # None: a 16-bit cache (unscaled)
    softmax_t: torch.Tensor | None = None
    k_scale_t: torch.Tensor | None = None


_SCALARS: dict[tuple, torch.Tensor] = {}


def device_scalar(value: float, device: torch.device) -> torch.Tensor:
    """A cached fp32 ``[1]`` device tensor holding ``value`` (a kernel argument), so that steady-state calls copy
    nothing; made outside CUDA-graph capture (a host-to-device copy)."""
    key = (float(value), device)
    t = _SCALARS.get(key)
    if t is None:
        if capturing(device):
            raise MLAInputError(f"mla_decode: softmax_scale/k_scale {value} first seen during CUDA-graph capture; "
                                "run one eager call with the same scales before capturing")
        t = _SCALARS[key] = torch.tensor([float(value)], dtype=torch.float32, device=device)
    return t


def checked_k_scale(softmax_scale, k_scale, kv_dtype: torch.dtype, device: torch.device,
                    caller: str = "mla_decode"):
    """Check both scales (``validation.check_scales``) and return the ``k_scale`` the cache takes: required (float or
    fp32 tensor) for an fp8 cache; None for a 16-bit one, which refuses a float other than 1.0 (an engine's unit
    scale tensor is ignored)."""
    check_scales(softmax_scale, k_scale, device, caller)
    if kv_dtype in FP8_DTYPES:
        if k_scale is None:
            fail("k_scale", None, f"the dequantisation scale of the {kv_dtype} kv_cache (real = stored * k_scale): "
                 "a finite positive float or an fp32 device tensor; 1.0 for a plain cast", caller)
        return k_scale
    if k_scale is not None and not isinstance(k_scale, torch.Tensor) and float(k_scale) != 1.0:
        raise MLAInputError(f"{caller}: k_scale={k_scale} is only meaningful for an fp8 kv_cache, got {kv_dtype}")
    return None


def checked_fp8_compute(fp8_compute, kv_dtype: torch.dtype, caller: str = "mla_decode") -> bool:
    """``fp8_compute`` as a bool: True asks for e4m3 tensor cores, so it needs an fp8 cache."""
    if not isinstance(fp8_compute, bool):
        fail("fp8_compute", repr(fp8_compute), "True or False", caller)
    if fp8_compute and kv_dtype not in FP8_DTYPES:
        fail("fp8_compute", True, f"with an fp8 kv_cache (float8_e4m3fn on sm90); this cache is {kv_dtype}: pass False",
             caller)
    return fp8_compute


def kernel_scales(softmax_scale: float, k_scale, device: torch.device) -> Scales:
    """:class:`Scales` with the kernels' tensors: a tensor ``k_scale`` is read in place when it is fp32 (its value at
    each launch), else converted once here."""
    if isinstance(k_scale, torch.Tensor):
        k_scale_t = k_scale.detach().reshape(1).float()  # a view of the same storage (an engine's Parameter too)
    else:
        k_scale_t = device_scalar(1.0 if k_scale is None else k_scale, device)
    return Scales(softmax_scale, k_scale, device_scalar(softmax_scale, device), k_scale_t)


# ---------------------------------------------------------------------- variants
def _rows_aligned(x: torch.Tensor, step: int) -> torch.Tensor:
    """``x [T, H, D]`` as the kernels read q, through its (token, head) strides: the last dim dense and every row
    16-byte aligned (vectorised / cp.async loads), ``step`` = 16 bytes in elements; anything else is copied once."""
    s = x.stride()
    if s[2] == 1 and not (s[0] | s[1]) % step and not x.data_ptr() % 16:
        return x
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


class KernelVariant:
    """The TileLang split and combine kernels of one shape, resolved to their launch entries."""

    is_reference = False

    def __init__(self, num_heads: int, q_len: int, page_size: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                 arch: str, reason: str, fp8_compute: bool = False):
        from .kernels import runtime

        self.fp8_compute = fp8_compute and fp8_compute_applies(arch, num_heads, q_len, kv_dtype != dtype)
        cfg = config_for(arch, self.fp8_compute)
        self.arch, self.kernel, self.block_n, self.reason = arch, cfg.kernel, cfg.block_n, reason
        self.kernels = runtime.launch_entries(runtime.get_kernels(num_heads, q_len, page_size, dtype, kv_dtype, arch,
                                                                  cfg))
        self._runtime = runtime  # pick_combine is looked up at each call (tests force one combine)
        self._step = 16 // dtype.itemsize
        self._cu = (None, -1, None)  # (plan.cu_blocks, batch, its [:batch + 1] view): one tuple, replaced whole

    def run(self, q_nope, q_pe, kv_cache, md, plan, out, lse, scales: Scales):
        """Launch the split kernel, then the combine ``runtime.pick_combine`` picks, writing ``out`` and ``lse``."""
        batch = md.kv_lens.shape[0]
        try:
            cu_all = plan.cu_blocks
        except AttributeError:
            raise MLAInputError("MLADecodeLauncher: metadata.plan is None; plan the step with a SplitPlanner "
                                "(metadata.plan = planner.plan(metadata.kv_lens)) before the layers run") from None
        memo = self._cu
        if memo[0] is cu_all and memo[1] == batch:
            cu = memo[2]
        else:
            cu = cu_all[: batch + 1]
            self._cu = (cu_all, batch, cu)
        step = self._step
        q_nope, q_pe = _rows_aligned(q_nope, step), _rows_aligned(q_pe, step)
        kernels = self.kernels
        kernels.split(q_nope, q_pe, kv_cache, scales.k_scale_t, md.page_table, md.page_table_start, md.kv_lens,
                      md.qo_indptr, cu, plan.part_begin_req, plan.part_end_req, plan.part_start, plan.req_parts,
                      scales.softmax_t, out, lse, plan.out_partial, plan.lse_partial)
        # The combine runs whatever the plan: it writes empty requests and merges split ones (the host does not know
        # the lengths).
        combine = self._runtime.pick_combine(kernels, batch, plan.rows, plan.num_parts)
        combine(md.qo_indptr, cu, plan.req_parts, plan.out_partial, plan.lse_partial, out, lse)
        if verify.VERIFYING and not capturing(q_nope.device):
            verify.verify_call(q_nope, q_pe, kv_cache, md, scales.softmax_scale, scales.k_scale, out, lse,
                               self.fp8_compute)
        return out, lse


class ReferenceVariant:
    """The fp32 PyTorch reference (no kernel for this device or shape, or ``impl="reference"``)."""

    is_reference = True

    def __init__(self, reason: str):
        self.reason = reason

    def capture_error(self) -> MLAInputError:
        return MLAInputError(f"mla_decode: the PyTorch reference path ({self.reason}) cannot run inside CUDA-graph "
                             "capture; run eagerly, or on a GPU the TileLang kernel supports")

    def run(self, q_nope, q_pe, kv_cache, md, plan, out, lse, scales: Scales):
        """The reference's own ``(out, lse)`` (``out`` filled when given); ``plan`` and ``lse`` are not used."""
        if capturing(q_nope.device):  # it reads the lengths on the host: torch would fail deep inside it
            raise self.capture_error()
        k_scale = float(scales.k_scale) if scales.k_scale is not None else 1.0
        return mla_decode_reference(q_nope, q_pe, kv_cache, md, scales.softmax_scale, k_scale, out)


_VARIANTS: dict[tuple, KernelVariant | ReferenceVariant] = {}


def prepare_variant(device: torch.device, num_heads: int, q_len: int | None, page_size: int, dtype: torch.dtype,
                    kv_dtype: torch.dtype, impl: str = "auto",
                    fp8_compute: bool = False) -> KernelVariant | ReferenceVariant:
    """The variant ``mla_decode`` runs for this shape (``dispatch.select_impl``, logged once), its kernels compiled
    or loaded on first use; cached per process. Raises ValueError where an explicit ``impl`` cannot run."""
    key = (device, num_heads, q_len, page_size, dtype, kv_dtype, impl, fp8_compute)
    variant = _VARIANTS.get(key)
    if variant is None:
        choice = select_impl(device, dtype, kv_dtype, num_heads, q_len, page_size, impl)
        log_choice(choice, (device.type, dtype, kv_dtype, num_heads, q_len, page_size))
        if choice.impl == REFERENCE:
            variant = ReferenceVariant(choice.reason)
        else:
            variant = KernelVariant(num_heads, q_len, page_size, dtype, kv_dtype, choice.impl.split("-", 1)[1],
                                    choice.reason, fp8_compute)
        _VARIANTS[key] = variant
    return variant


class _Unprepared:
    """A q_len the launcher was not built for: prepared at its first call, outside CUDA-graph capture."""

    def __init__(self, launcher: "MLADecodeLauncher", q_len: int | None):
        self.launcher, self.q_len = launcher, q_len

    def run(self, q_nope, q_pe, kv_cache, md, plan, out, lse, scales: Scales):
        launcher = self.launcher
        if capturing(launcher.device):
            raise MLAInputError(f"MLADecodeLauncher: metadata.q_len={self.q_len} is not among the q_lens "
                                f"{launcher.q_lens} it was built with, and the stream is capturing a CUDA graph (its "
                                f"kernels may need compiling); build it with q_lens including {self.q_len}")
        return launcher._prepare(self.q_len).run(q_nope, q_pe, kv_cache, md, plan, out, lse, scales)


# ---------------------------------------------------------------------- the launcher
_CALLER = "MLADecodeLauncher"


def _host_arg(check, value, arg: str, **kwargs):
    try:
        return check(value, arg, **kwargs)
    except MLAInputError as exc:
        raise MLAInputError(f"{_CALLER}: {exc}") from None


class MLADecodeLauncher:
    """``mla_decode`` for one layer shape, prepared at build: a call only launches.

    Build it once per layer (or per shape and scales), outside CUDA-graph capture::

        launch = MLADecodeLauncher(device, num_heads, page_size=64, dtype=torch.bfloat16,
                                   softmax_scale=scale, q_lens=(1, 2))
        metadata.plan = planner.plan(metadata.kv_lens)   # once per step (SplitPlanner)
        out = launch(q_nope, q_pe, kv_cache, metadata, out)   # per layer

    Args:
        device: the device of q, the cache and the metadata.
        num_heads: query heads per GPU.
        page_size: tokens per page (``kv_cache.shape[1]``).
        dtype: q's and the output's dtype (float16 / bfloat16 for the kernels; float32 runs the reference).
        softmax_scale: the model's scale, finite and positive.
        kv_dtype: the cache's dtype: ``dtype`` (default), float8_e4m3fn (sm90) or float8_e4m3fnuz (gfx942).
        k_scale: dequantisation scale of an fp8 cache (required; 1.0 for a plain cast): a float, or a 1-element
            floating tensor on ``device``. An fp32 tensor is read at each launch (an engine's persistent
            ``layer._k_scale`` keeps working when it is refilled in place); another dtype is converted here, once.
            A 16-bit cache takes None (or 1.0; a tensor is ignored).
        q_lens: queries per request the kernels are prepared (compiled or loaded) for at build, each 1..4; None
            prepares the reference for ragged batches. A call with another q_len prepares it then, outside capture.
        impl: as ``mla_decode``'s ("auto", "reference", "tilelang-sm90", "tilelang-gfx942"). Where no kernel can run
            (a CPU, another GPU, an unsupported shape under "auto") the launcher runs the fp32 reference, logged as
            ``mla_decode`` logs it.
        fp8_compute: as ``mla_decode``'s: an fp8 cache on e4m3 tensor cores, q quantised per (token, head) row.

    A call ``launch(q_nope, q_pe, kv_cache, metadata, out=None, return_lse=False)`` takes q_nope
    ``[T, num_heads, 512]`` and q_pe ``[T, num_heads, 64]`` (views are fine: rows must be 16-byte aligned or they are
    copied), kv_cache ``[num_pages, page_size, 576]``, an :class:`~mla_backend.MLADecodeMetadata` whose ``plan``
    was made by a :class:`~mla_backend.SplitPlanner` for ``num_heads`` and its ``q_len``, and returns ``out`` (a new
    tensor when None), or ``(out, lse)``. Nothing is checked: run ``mla_decode`` (or ``metadata.check``) where the inputs
    are not known good. The kernels' own host code still checks each tensor's dtype, rank, shape and device.

    The LSE: with ``return_lse`` a new ``[T, num_heads]`` fp32 tensor the caller may keep (vLLM's DCP merges it after
    the call). Without, the kernels write it into a scratch buffer of the launcher (grown outside capture, to twice
    its size; the smaller ones are kept for the graphs captured with them), so a call with ``out`` allocates nothing.
    One launcher serves one stream at a time (as one plan does).
    """

    def __init__(self, device: torch.device | str, num_heads: int, *, page_size: int, dtype: torch.dtype,
                 softmax_scale: float, kv_dtype: torch.dtype | None = None, k_scale=None, q_lens=(1,),
                 impl: str = "auto", fp8_compute: bool = False):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if capturing(device):
            raise MLAInputError(f"{_CALLER}: built during CUDA-graph capture; build it before capturing (it copies "
                                "its scales to the device and may compile kernels)")
        if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads < 1:
            fail("num_heads", repr(num_heads), "an int >= 1 (query heads per GPU; the kernels take 1..128)", _CALLER)
        page_size = _host_arg(check_page_size, page_size, "page_size")
        if isinstance(q_lens, int) or not q_lens:
            fail("q_lens", repr(q_lens), "a non-empty sequence of ints in 1..4 (or None for ragged batches)", _CALLER)
        q_lens = tuple(dict.fromkeys(_host_arg(check_q_len, q, "q_lens", allow_none=True) for q in q_lens))
        if dtype not in Q_DTYPES:
            fail("dtype", dtype, "torch.float16 or torch.bfloat16 (torch.float32: reference only)", _CALLER)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in KV_DTYPES or (kv_dtype not in FP8_DTYPES and kv_dtype != dtype):
            fail("kv_dtype", kv_dtype, f"the query dtype ({dtype}), torch.float8_e4m3fn (sm90) or "
                 "torch.float8_e4m3fnuz (gfx942)", _CALLER)
        k_scale = checked_k_scale(softmax_scale, k_scale, kv_dtype, device, _CALLER)
        self.fp8_compute = checked_fp8_compute(fp8_compute, kv_dtype, _CALLER)
        num_heads = int(num_heads)
        self.device, self.num_heads, self.page_size, self.dtype, self.kv_dtype = device, num_heads, page_size, dtype, \
            kv_dtype
        self.impl, self.q_lens = impl, q_lens
        self.softmax_scale, self.k_scale = float(softmax_scale), k_scale
        # index q_len (0: None, a ragged batch)
        self._variants: list = [_Unprepared(self, q_len or None) for q_len in range(MAX_Q_LEN + 1)]
        for q_len in q_lens:
            self._prepare(q_len)
        self._scales = kernel_scales(self.softmax_scale, k_scale, device)
        self._lse = torch.empty((0, num_heads), dtype=torch.float32, device=device)
        self._lse_view = (0, self._lse)  # (rows, the scratch's [:rows] view): one tuple, replaced whole
        self._retired: list[torch.Tensor] = []

    def _prepare(self, q_len: int | None):
        try:
            variant = prepare_variant(self.device, self.num_heads, q_len, self.page_size, self.dtype, self.kv_dtype,
                                      self.impl, self.fp8_compute)
        except MLAInputError:
            raise
        except ValueError as exc:  # dispatch's refusal of an explicit impl
            raise MLAInputError(f"{_CALLER}: {str(exc).removeprefix('mla_decode: ')}") from None
        self._variants[q_len or 0] = variant
        return variant

    def variant(self, q_len: int | None):
        """The prepared variant of ``q_len`` (``is_reference``, ``reason``), preparing it if needed."""
        variant = self._variants[q_len or 0]
        return self._prepare(q_len) if isinstance(variant, _Unprepared) else variant

    def _scratch_lse(self, rows: int) -> torch.Tensor:
        lse = self._lse
        if lse.shape[0] < rows:
            if capturing(self.device):  # from the graph's pool, for this capture only
                return torch.empty((rows, self.num_heads), dtype=torch.float32, device=self.device)
            self._retired.append(lse)  # graphs captured with it keep writing it
            lse = self._lse = torch.empty((max(rows, 2 * lse.shape[0]), self.num_heads), dtype=torch.float32,
                                          device=self.device)
        view = lse[:rows]
        self._lse_view = (rows, view)
        return view

    def __call__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, metadata,
                 out: torch.Tensor | None = None, return_lse: bool = False):
        num_tokens = q_nope.shape[0]
        if out is None:
            out = torch.empty((num_tokens, self.num_heads, KV_LORA_RANK), dtype=self.dtype, device=self.device)
        if return_lse:
            lse = torch.empty((num_tokens, self.num_heads), dtype=torch.float32, device=self.device)
        else:
            memo = self._lse_view
            lse = memo[1] if memo[0] == num_tokens else self._scratch_lse(num_tokens)
        if num_tokens:
            out, lse = self._variants[metadata.q_len or 0].run(q_nope, q_pe, kv_cache, metadata, metadata.plan, out,
                                                               lse, self._scales)
        return (out, lse) if return_lse else out

    def __repr__(self) -> str:
        kinds = {q: ("reference" if v.is_reference else f"tilelang-{v.arch}" + ("-fp8compute" if v.fp8_compute else ""))
                 for q, v in ((q, self._variants[q or 0]) for q in self.q_lens)}
        return (f"MLADecodeLauncher({self.device}, heads={self.num_heads}, page={self.page_size}, {self.dtype}/"
                f"{self.kv_dtype}, q_lens {kinds})")

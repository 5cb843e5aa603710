"""vLLM decode batch -> canonical :class:`~mla_backend.MLADecodeMetadata` (torch only, no vLLM import).

vLLM hands the MLA metadata builder, for the decode rows at the front of the batch:

* ``block_table`` int32 ``[num_decodes, max_blocks]``: rows ``[:num_decodes]`` of the model runner's
  persistent block table (kernel-size block ids; padded rows of a CUDA-graph batch hold block 0);
* ``seq_lens`` int32 ``[num_decodes]``: KV lengths including the new tokens (0 for padded rows);
* ``query_start_loc_cpu`` int32 ``[num_decodes + 1]`` on the host (padded rows have 0 queries);
* ``num_decode_tokens``: rows of q handed to ``forward_mqa`` (``num_decodes * q_len`` in a uniform batch,
  the padded rows included).

Under FULL CUDA graphs the builder runs outside the graph and every replay reads the tensors the
capture saw, so all metadata the kernels read must live in storage that never moves:
``page_table`` is a flat view of vLLM's persistent block table, ``kv_lens`` is vLLM's persistent
``seq_lens``, and ``page_table_start``, ``qo_indptr`` and the split plan live in buffers owned here,
refilled in place with device ops only (no host sync).
"""

from __future__ import annotations

import torch

from ..constants import MAX_Q_LEN
from ..metadata import INDEX_DTYPE, MetadataSource, MLADecodeMetadata
from ..planner import SplitPlanner

#: Most metadata objects a builder keeps (one per batch size and query length over vLLM's persistent buffers).
MAX_BUILT = 1024


def uniform_query_len(query_start_loc_cpu: torch.Tensor, num_decode_tokens: int) -> int:
    """The common query length of a uniform decode batch, from host data only.

    Rows with 0 queries are CUDA-graph padding and are allowed; every other row must have the same
    length, and ``num_decode_tokens`` must equal ``num_rows * q_len`` (the padded rows' query slots
    included), which is what vLLM guarantees for UNIFORM query-length backends.
    """
    if query_start_loc_cpu.device.type != "cpu":
        raise ValueError("query_start_loc_cpu must be a host tensor (no device sync on the decode path)")
    num_rows = query_start_loc_cpu.shape[0] - 1
    if num_rows <= 0:
        raise ValueError("empty decode batch")
    # One torch call, then Python builtins over a list. Between two steps the engine's model code pushes this
    # code and its data out of the CPU's caches, and a cold call costs what it touches: numpy's three small array
    # ops cost several times a list and builtins there (docs/api.md, "Hot and cold host time"). Every length is 0
    # or the longest, q_len, iff the non-zero ones sum to q_len times their count (none exceeds it).
    starts = query_start_loc_cpu.tolist()
    lens = [end - start for start, end in zip(starts, starts[1:])]
    q_len = max(lens)
    if q_len < 1 or q_len * (num_rows - lens.count(0)) != starts[-1] - starts[0]:
        raise ValueError(f"decode batch is not uniform: query lengths {lens[:16]}")
    if num_decode_tokens != num_rows * q_len:
        raise ValueError(f"num_decode_tokens={num_decode_tokens} != num_decodes ({num_rows}) * q_len ({q_len})")
    return q_len


class DecodeMetadataBuilder:
    """Owns the persistent buffers of one vLLM metadata builder and turns each decode batch into
    canonical metadata with an attached split plan.

    Args:
        max_batch: most decode rows per step (vLLM's ``max_num_seqs``).
        num_heads: local query heads (after tensor parallelism).
        page_size: vLLM's kernel block size.
        q_lens: query lengths to plan for up front (``1 .. reorder_batch_threshold``); others <= 4
            get a planner on first use.
        device: where vLLM's tensors live.
        num_sms: override the SM count the planner cuts work for (tests).
    """

    def __init__(self, max_batch: int, num_heads: int, page_size: int, q_lens, device: torch.device | str,
                 num_sms: int | None = None):
        self.device = torch.device(device)
        self.max_batch = int(max_batch)
        self.num_heads = int(num_heads)
        self.page_size = int(page_size)
        self._num_sms = num_sms
        i32 = dict(dtype=INDEX_DTYPE, device=self.device)
        self._arange = torch.arange(self.max_batch + 1, **i32)
        self._page_table_start = torch.zeros(self.max_batch, **i32)
        self._start_stride = 0  # the row stride _page_table_start currently holds (0: all zeros)
        self._qo_indptr: dict[int, torch.Tensor] = {}
        self._planners: dict[int, SplitPlanner] = {}
        # (q_len, batch, table row stride and width, storage of the table and of seq_lens) -> the metadata over them;
        # its qo_indptr and page_table_start are views of this builder's buffers, refilled in place
        self._built: dict[tuple, MLADecodeMetadata] = {}
        for q_len in q_lens:
            self._ensure_q_len(int(q_len))

    # ------------------------------------------------------------------ buffers
    def _ensure_q_len(self, q_len: int) -> None:
        if q_len in self._planners:
            return
        if not 1 <= q_len <= MAX_Q_LEN:
            raise ValueError(f"q_len={q_len}: the TileLang kernels take 1..{MAX_Q_LEN} queries per request "
                             f"(1 + num_speculative_tokens)")
        self._qo_indptr[q_len] = self._arange * q_len
        self._planners[q_len] = SplitPlanner(self.max_batch, self.num_heads, q_len, self.device, num_sms=self._num_sms)

    def plan_buffer_bytes(self) -> int:
        """Device bytes held by the split plans (for the start-up log)."""
        total = 0
        for planner in self._planners.values():
            plan = getattr(planner, "buffers", None)  # the planner's persistent SplitPlan
            for name in ("out_partial", "lse_partial", "cu_blocks", "part_begin_req", "part_end_req", "part_start",
                         "req_parts"):
                t = getattr(plan, name, None)
                total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        return total

    @property
    def q_lens(self) -> tuple[int, ...]:
        return tuple(sorted(self._planners))

    def planner(self, q_len: int) -> SplitPlanner:
        return self._planners[q_len]

    # ------------------------------------------------------------------ per step
    def _metadata(self, block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int, row_stride: int,
                  row_pages: int) -> MLADecodeMetadata:
        batch = block_table.shape[0]
        return MLADecodeMetadata(
            kv_lens=seq_lens,
            qo_indptr=self._qo_indptr[q_len][: batch + 1],
            # A view of the rows' storage (same data pointer as vLLM's persistent table).
            page_table=block_table.as_strided(((batch - 1) * row_stride + row_pages,), (1,)),
            page_table_start=self._page_table_start[:batch],
            page_size=self.page_size,
            q_len=q_len,
            # The row width, so that check_indices holds each request to its own row, not only to the table's end.
            source=MetadataSource("block_table", row_pages=row_pages),
        )

    def build(self, block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc_cpu: torch.Tensor,
              num_decode_tokens: int, max_seq_len: int | None = None, plan: bool = True) -> MLADecodeMetadata:
        """Canonical metadata for one decode batch, with ``.plan`` filled (device ops only). ``plan=False``: ``.plan``
        is the planner's persistent plan, not yet made for this batch; ``planner(q_len).plan(metadata.kv_lens)`` makes
        it (the plugin does so in the step's first attention call, inside a captured graph where there is one)."""
        batch = block_table.shape[0]
        if block_table.dim() != 2 or block_table.dtype != INDEX_DTYPE:
            raise ValueError(f"block_table must be int32 [batch, max_blocks], got {block_table.dtype} "
                             f"{tuple(block_table.shape)}")
        if seq_lens.shape != (batch,) or seq_lens.dtype != INDEX_DTYPE:
            # int32 is read in place: a converted copy would be new storage every step (stale in CUDA graphs)
            raise ValueError(f"seq_lens must be int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
        if batch > self.max_batch:
            raise ValueError(f"{batch} decode rows exceed max_num_seqs={self.max_batch}")
        if block_table.stride(1) != 1 and block_table.shape[1] > 1:
            raise ValueError("block_table rows must be contiguous (vLLM's persistent block table is)")
        q_len = uniform_query_len(query_start_loc_cpu, num_decode_tokens)
        self._ensure_q_len(q_len)

        row_stride = block_table.stride(0) if block_table.shape[1] > 0 else 0
        if row_stride != self._start_stride:
            # Constant for vLLM's persistent table (max_num_blocks_per_req), so this runs once.
            torch.mul(self._arange[: self.max_batch], row_stride, out=self._page_table_start)
            self._start_stride = row_stride
        row_pages = block_table.shape[1]
        # vLLM hands views of its persistent buffers, new tensor objects over the same storage each step: the
        # metadata made for a storage and shape is made once and handed out again (a cold construction costs more
        # than the key; docs/api.md, "Hot and cold host time").
        key = (q_len, batch, row_stride, row_pages, block_table.data_ptr(), seq_lens.data_ptr(), seq_lens.stride(0))
        metadata = self._built.get(key)
        if metadata is None:
            if len(self._built) >= MAX_BUILT:  # storage that moves every step (not vLLM's): keep the cache bounded
                self._built.clear()
            metadata = self._built[key] = self._metadata(block_table, seq_lens, q_len, row_stride, row_pages)
        metadata.max_kv_len = max_seq_len
        planner = self._planners[q_len]
        metadata.plan = planner.plan(metadata.kv_lens) if plan else planner.buffers
        return metadata


def decode_q_len_limit(num_speculative_tokens: int | None, parallel_drafting: bool = False) -> int:
    """Largest decode query length vLLM will route to the decode path (its reorder threshold)."""
    if not num_speculative_tokens:
        return 1
    return 1 + (2 if parallel_drafting else 1) * int(num_speculative_tokens)


__all__ = ["DecodeMetadataBuilder", "decode_q_len_limit", "uniform_query_len"]

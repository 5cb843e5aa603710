"""Shapes and limits of the MLA decode op, in one place.

DeepSeek-V3's latent attention: every query head attends over one shared 576-wide cache row per token,
``[c_kv (512) | k_pe (64)]``; the 512 latent dims are also the values, so the output is 512 wide.
"""

KV_LORA_RANK = 512  # width of the latent c_kv, which is also V and the output
ROPE_DIM = 64  # width of k_pe / q_pe
HEAD_DIM = KV_LORA_RANK + ROPE_DIM  # 576: one cache row, one query row

# What the kernels accept; anything else runs the reference under impl="auto" (dispatch.py).
SUPPORTED_DTYPES = ("float16", "bfloat16")
SUPPORTED_KV_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_HEADS = 128
MAX_Q_LEN = 4  # queries per request: decode plus up to 3 MTP draft tokens, causal
# Most split-KV parts a plan may have: the combine kernel keeps one LSE per part of a request in shared memory.
MAX_PARTS = 256

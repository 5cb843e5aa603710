"""mla_backend: a framework-neutral MLA (DeepSeek-V3) paged decode op with TileLang kernels, and
plugins that register it as an attention backend in vLLM and SGLang."""

from .dispatch import Warmup, warmup
from .launcher import MLADecodeLauncher
from .metadata import MLADecodeMetadata
from .op import mla_decode
from .planner import SplitPlan, SplitPlanner, plan_split_kv
from .reference import mla_decode_reference
from .validation import MLAInputError

__all__ = ["MLADecodeLauncher", "MLADecodeMetadata", "MLAInputError", "SplitPlan", "SplitPlanner", "Warmup",
           "mla_decode", "mla_decode_reference", "plan_split_kv", "warmup"]
__version__ = "0.1.0"

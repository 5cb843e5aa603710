"""Teacher forcing in vLLM: a logits processor that makes a request emit ``extra_args["force_tokens"]``.

A module of its own so that vLLM can load the class by name (``FORCE_TOKENS``) in every worker process, tensor
parallel ones included. vLLM computes the logprobs it returns before logits processors run (``raw_logprobs``, its
default), so a request's rank-1 logprob at each step is the model's own greedy choice given the forced context.
vLLM 0.26 refuses custom logits processors when speculative decoding is on.
"""

from __future__ import annotations

from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

#: What ``LLM(logits_processors=[...])`` takes: ``module:class``.
FORCE_TOKENS = "mla_backend.serve_bench.vllm_forcing:ForceTokens"


class ForceTokens(AdapterLogitsProcessor):
    """Per request with ``extra_args={"force_tokens": [...]}``: every logit but the scripted token's is -inf."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        force = (params.extra_args or {}).get("force_tokens")
        if not force:
            return None

        def force_next(output_ids, logits):
            token = force[min(len(output_ids), len(force) - 1)]
            logits.fill_(float("-inf"))
            logits[token] = 0.0
            return logits

        return force_next

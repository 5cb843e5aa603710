# session 24, call 6: the side-by-side bench below, but on a fresh machine (the one of calls 4-5 had been handed back),
# so vLLM's other bundles and TileLang were missing and nothing but the reference ran; not recorded. Calls 7-8 set up
# a machine again (vllm-c; vllm-deps + tilelang + the bench's precompiles) and call 9 ran this command there.

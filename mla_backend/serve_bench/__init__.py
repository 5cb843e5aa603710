"""``mla-backend serve-bench``: served speed (decode TPOT, offline throughput, chunked prefill under decode) of our
attention backend and the engine's built-in ones, through vLLM's or SGLang's own offline paths, on a
DeepSeek-V3-shaped model with dummy weights. Entry point: :func:`mla_backend.serve_bench.driver.main`.

Modules: ``model_config`` (the models), ``weight_memory`` (weight bytes per GPU), ``parallel`` (the multi-GPU
options and the layer count that fits), ``workloads`` (what is measured), ``measure`` (timing from token arrivals),
``profile_trace`` (the attention share), ``random_weights`` (scaled dummy weights, shared with tests/e2e),
``runner_common`` / ``vllm_runner`` / ``sglang_runner`` (one engine process per backend), ``driver`` (the command),
``report`` (JSON, markdown, plot).
"""

"""The native rollout engine (backend ``native``): token ids in, token ids out, on any torch device.

``native``       the engine: async per-request API, abort and resume, pause, memory release,
                 atomic weight updates, deterministic mode
``continuous``   its continuous batching over a slot KV cache, batched and cross-turn prefix prefill
``kv_cache``     its decoder forward over the slot cache (the model's own submodules)
``cuda_graphs``  its decode step as CUDA graphs per (rows, columns) bucket
``sampling``     batched temperature / top-k / top-p / min-p sampling, seeded per request

Its log-probs come from :mod:`loongsage.core.model_math`, as the trainers' do.
"""

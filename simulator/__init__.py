"""A vLLM model-server simulator: an engine that behaves like vLLM V1, in real or virtual time.

Modules, from the bottom up:

- ``profiles``: step-time model and KV-cache size of a model on a GPU (``Profile``).
- ``tokenizer``: deterministic cheap tokenizer, chat template and generated words.
- ``kv_cache``: paged KV cache with prefix caching (``KVCache``).
- ``lora``: LoRA adapter residency in GPU slots and the CPU cache (``AdapterSlots``).
- ``request``: a request as submitted (``RequestSpec``) and its record of progress (``Request``).
- ``step_log``: when each step ended, where steady requests read their token times (``StepLog``).
- ``block_hashes``: what identifies a full KV block (content descriptions, chained hashes).
- ``prefix_sharing``: which full blocks enter the prefix cache, and when (``PrefixSharing``).
- ``steady``: the fast path for decoding requests the engine does not walk (``SteadyRequests``).
- ``reports``: what the engine reports (``StepPlan``, ``StepResult``, ``EngineCounters``, ...).
- ``engine``: the scheduler loop, one step at a time, with an injected clock (``Engine``); every
  public name above that drivers use is importable from it too.
- ``virtual_time``: a discrete-event driver for many engines, no sleeping (``VirtualFleet``).
- ``realtime``: an asyncio driver that paces one engine against the wall clock (``EngineRunner``).
- ``metrics_page``: vLLM's ``/metrics`` page in V1 or V0 format (``MetricsPage``).
- ``http_server`` / ``http_app``: a small HTTP/1.1 server and the OpenAI-style routes of a pod.
- ``main``: the ``lig sim`` command.
"""

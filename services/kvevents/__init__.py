"""lig kv-events: vLLM KV-cache events of every pod, republished on NATS."""

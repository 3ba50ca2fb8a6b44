"""Code every lig service uses: message schemas, subjects, NATS and logging helpers, the vLLM
metrics parser."""

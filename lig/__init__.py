"""The ``lig`` command: one entry point for every service and tool of llm-instance-gateway."""

"""Attack and chaos tools that prove the gateway's resilience against a running stack.

``python -m resilience attack`` floods a picker's ext_proc port with HTTP/2 abuse and sends
malformed HTTP through Envoy, ``python -m resilience chaos`` kills and stops services under load;
both print a table of figures with PASS/MISS per target (docs/resilience.md).
"""

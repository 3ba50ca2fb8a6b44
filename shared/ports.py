"""The well-known ports of every service: the one place their defaults are written.

The services' flags, ``lig up``'s local layout, the Envoy bootstrap and the deploy manifests all
use these numbers, so a default changed here changes everywhere.
"""

from __future__ import annotations

NATS = 4222
GATEWAY = 8081  # Envoy's listener for OpenAI requests
ENVOY_ADMIN = 9901
SIMULATOR_BASE = 8000  # the first simulated pod; the others follow
PICKER_GRPC = 9002  # ext_proc
PICKER_HEALTH = 9003  # gRPC health
PICKER_METRICS = 9090
COLLECTOR_METRICS = 9091
REGISTRY_METRICS = 9092
KV_EVENTS = 5557  # vLLM's default KV-cache event PUB port (--kv-events-config)
KV_EVENTS_REPLAY = 5558  # the replay ROUTER port vLLM's docs use
KV_EVENTS_METRICS = 9093  # lig kv-events' own /metrics
PROMETHEUS = 9095  # lig up --observe: the Prometheus that scrapes the stack
# lig sim hosts many pods on one host, so pod i's KV-event sockets sit at a base + i (lig up,
# compose and the Kubernetes demo); lig kv-events reaches them as offsets from the serving port.
SIMULATOR_KV_EVENTS_BASE = 7000  # pod i's PUB socket: 7000 + i (SIMULATOR_BASE - 1000)
SIMULATOR_KV_REPLAY_BASE = 7500  # pod i's replay ROUTER socket: 7500 + i (SIMULATOR_BASE - 500)

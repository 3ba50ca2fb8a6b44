"""Test helpers that start real processes (NATS, Envoy, simulators) on loopback."""

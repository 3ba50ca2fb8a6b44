"""The registry service: publishes pools, models and endpoints from YAML into JetStream KV."""

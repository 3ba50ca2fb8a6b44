"""The collector: scrapes each model-server pod's ``/metrics`` and publishes snapshots on NATS."""

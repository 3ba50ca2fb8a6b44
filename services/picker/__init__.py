"""The endpoint picker: Envoy ext_proc server fed with registry and metrics state from NATS."""

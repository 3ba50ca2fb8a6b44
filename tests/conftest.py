"""Fixtures shared by the suites; each lives in tests/support/ beside its helpers."""

pytest_plugins = ["tests.support.nats_server"]

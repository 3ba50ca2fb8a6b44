"""Fixtures shared by the suites; each lives in tests/support/ beside its helpers."""

pytest_plugins = [
    "tests.support.nats_server",
    "tests.support.nats_cluster",
    "tests.support.metrics_pages",
    "tests.support.envoy",
    "tests.support.picker",
    "tests.support.simulator",
    "tests.support.kube_apiserver",
    "tests.support.process_marker",
    "tests.support.process_leaks",
]

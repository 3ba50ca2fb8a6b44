"""Hand-written protocol code, kept apart from the services that use it.

It exists only where a benchmark showed the library too slow for a hot path, and is tested like
a library would be (limits, floods, slow and hostile peers):

- :mod:`protocols.http2`: the picker's built-in gRPC-over-HTTP/2 server (ext_proc), with
  :mod:`protocols.http2_limits`, its resource limits and budgets (docs/picker-http2.md).
  Tests: ``tests/test_picker_http2.py`` (the protocol), ``tests/test_picker_http2_limits.py``
  and ``tests/test_picker_http2_budget.py`` (each limit and the server-wide budget),
  ``tests/test_picker_http2_fuzz.py`` (the fuzz suite: Hypothesis-driven frame sequences);
  the peer they drive it with is ``tests/support/http2_peer.py``; benchmarks
  ``bench/bench_picker.py`` and ``bench/bench_http2_limits.py``.
- :mod:`protocols.http_transport`: the collector's keep-alive HTTP/1.1 transport for httpx (on
  h11). Tests: ``tests/test_collector_http.py``; benchmark ``bench/bench_collector.py``.

Nothing here imports a service: the dependencies point from ``services`` to ``protocols``.
"""

"""The service host: what every long-running ``lig`` service is built from.

- :mod:`.settings`: a typed settings Struct per service, each field declared once with its flag,
  help, default and environment variable (``LIG_`` + the flag's name), parsed in one place;
- :mod:`.errors`: the exceptions a service raises instead of exiting; the command line turns
  them into one line and an exit code;
- :mod:`.lifespan`: an ``AsyncExitStack`` that opens a service's resources (metrics server,
  NATS connection, tasks) and releases them in reverse order, each within a bound;
- :mod:`.metrics_http`: the Prometheus ``/metrics`` server.
"""

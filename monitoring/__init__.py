"""What turns the services' metrics into a picture and a page: the Grafana dashboards
(:mod:`monitoring.dashboards`), the Prometheus alerting rules (``lig-rules.yaml``, package data)
and the Prometheus configuration ``lig up --observe`` runs (:mod:`monitoring.prometheus`).
``deploy/render.py`` writes the dashboards and the rules to ``deploy/grafana`` and
``deploy/prometheus`` for deployments; docs/observability.md says what each shows."""

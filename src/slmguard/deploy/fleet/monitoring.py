"""Watching a fleet in Kubernetes: the ServiceMonitor, the alerts and a Grafana dashboard.

Owns ``render --target k8s``'s ``monitoring/`` directory, for a cluster with
the Prometheus Operator (its ``monitoring.coreos.com/v1`` CRDs; applied apart
from the workloads with ``kubectl apply -k monitoring/`` so a cluster without
them still takes the rest):

- ``servicemonitor.yaml``: every board's ``/metrics`` (behind the API key:
  the bearer credential is the same Secret the pods read), every 30 s;
- ``prometheusrule.yaml``: the alerts of :data:`ALERTS`: an OOM kill in the
  server container (cAdvisor's ``container_oom_events_total``: the kernel
  killed the engine, the front restarted it), an engine stalled and replaced,
  the governor shedding or worse for 10 minutes, engine restarts piling up,
  the pod itself restarting (kube-state-metrics), a server not ready;
- ``grafana-dashboard.yaml`` (a ConfigMap labelled ``grafana_dashboard: "1"``
  for Grafana's sidecar) and ``slmguard-dashboard.json`` (the same board, to
  import by hand): requests and tokens per second, the engine's memory against
  the governor's limit, the governor's level, the queue, restarts, stalls and
  OOM kills, per pod.

The ``slmguard_*`` names are the server's (``slmguard.serve.metrics``,
``slmguard.governor.metrics``), which this family may not import: the tests
scrape a real server and check that every name used here is one it exports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from slmguard import __version__
from slmguard.deploy.fleet import yamltext
from slmguard.deploy.fleet.yamltext import Commented, Literal

APP = "slmguard"
MONITOR_API = "monitoring.coreos.com/v1"
DASHBOARD_UID = "slmguard-fleet"
SCRAPE_INTERVAL = "30s"


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str  # PromQL; {ns} is the namespace, {sel} the server's series selector
    for_: str
    severity: str
    summary: str


ALERTS = (
    Alert(
        "SlmguardOOMKill",
        'increase(container_oom_events_total{{namespace="{ns}", container="server"}}[10m]) > 0',
        "0m",
        "warning",
        "The kernel OOM-killed a process of {{ $labels.pod }} (the engine: the front restarts "
        "it); the plan's MemoryMax is too small for what the board is asked.",
    ),
    Alert(
        "SlmguardEngineStalled",
        "increase(slmguard_engine_stalls_total{sel}[15m]) > 0",
        "0m",
        "warning",
        "{{ $labels.pod }} replaced an engine that made no progress.",
    ),
    Alert(
        "SlmguardShedding",
        'max by (pod) (slmguard_governor_level{{level=~"shed|degrade|critical"{and_sel}}}) > 0',
        "10m",
        "warning",
        "The governor of {{ $labels.pod }} has been shedding load or shrinking the context "
        "for 10 minutes: the board is short of memory for its traffic.",
    ),
    Alert(
        "SlmguardEngineRestarts",
        "increase(slmguard_engine_restarts_total{sel}[30m]) > 3",
        "0m",
        "warning",
        "The engine of {{ $labels.pod }} restarted more than 3 times in 30 minutes.",
    ),
    Alert(
        "SlmguardPodRestarts",
        'increase(kube_pod_container_status_restarts_total{{namespace="{ns}", '
        'container="server"}}[30m]) > 2',
        "0m",
        "critical",
        "{{ $labels.pod }} restarted more than twice in 30 minutes: the front itself fails.",
    ),
    Alert(
        "SlmguardNotServing",
        'max by (pod) (slmguard_state{{state=~"failed|stalled|parked"{and_sel}}}) > 0',
        "10m",
        "critical",
        "{{ $labels.pod }} has not served for 10 minutes (failed, stalled or parked).",
    ),
)


def _selector(ns: str) -> tuple[str, str]:
    """The server's series selector, alone and as extra matchers."""
    return f'{{namespace="{ns}"}}', f', namespace="{ns}"'


def alert_expr(alert: Alert, ns: str) -> str:
    sel, and_sel = _selector(ns)
    return alert.expr.format(ns=ns, sel=sel, and_sel=and_sel)


def _labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/version": __version__}


def service_monitor(namespace: str, secret: str, api_key: str) -> str:
    doc = {
        "apiVersion": MONITOR_API,
        "kind": "ServiceMonitor",
        "metadata": {"name": APP, "namespace": namespace, "labels": _labels()},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": APP}},
            "namespaceSelector": {"matchNames": [namespace]},
            "endpoints": [
                Commented(
                    {
                        "port": "http",
                        "path": "/metrics",
                        "interval": SCRAPE_INTERVAL,
                        "authorization": {
                            "type": "Bearer",
                            "credentials": {"name": secret, "key": api_key},
                        },
                    },
                    "/metrics is behind the API key: the same Secret the pods read.",
                )
            ],
        },
    }
    return yamltext.dump(doc, "Prometheus scrapes every board's server (Prometheus Operator).")


def prometheus_rule(namespace: str) -> str:
    rules = [
        {
            "alert": a.name,
            "expr": alert_expr(a, namespace),
            "for": a.for_,
            "labels": {"severity": a.severity},
            "annotations": {"summary": a.summary},
        }
        for a in ALERTS
    ]
    doc = {
        "apiVersion": MONITOR_API,
        "kind": "PrometheusRule",
        "metadata": {"name": APP, "namespace": namespace, "labels": _labels()},
        "spec": {"groups": [{"name": "slmguard", "rules": rules}]},
    }
    return yamltext.dump(doc, "Alerts for the fleet's servers (see docs/fleet.md).")


#: (title, unit, PromQL: one query a line) of each panel; {sel} selects the namespace.
PANELS = (
    ("Requests per second, by outcome", "reqps",
     "sum by (outcome) (rate(slmguard_requests_total{sel}[5m]))"),
    ("Completion tokens per second, by pod", "none",
     "sum by (pod) (rate(slmguard_completion_tokens_total{sel}[5m]))"),
    ("Engine memory", "bytes", "slmguard_engine_rss_bytes{sel}"),
    ("Governor: working set, and its limit", "bytes",
     "slmguard_governor_working_set_bytes{sel}\nslmguard_governor_limit_bytes{sel}"),
    ("Governor level (0 normal, 1 shed, 2 degrade, 3 critical)", "none",
     'max by (pod) (slmguard_governor_level{{level="shed"{and_sel}}} + '
     '2 * slmguard_governor_level{{level="degrade"{and_sel}}} + '
     '3 * slmguard_governor_level{{level="critical"{and_sel}}})'),
    ("Queue depth", "none", "slmguard_queue_depth{sel}"),
    ("Engine restarts and stalls (per hour)", "none",
     "sum by (pod) (increase(slmguard_engine_restarts_total{sel}[1h])) + "
     "sum by (pod) (increase(slmguard_engine_stalls_total{sel}[1h]))"),
    ("OOM kills in the server container (per hour)", "none",
     'sum by (pod) (increase(container_oom_events_total{{container="server"{and_sel}}}[1h]))'),
)  # fmt: skip


def dashboard(namespace: str) -> str:
    """The Grafana dashboard's JSON (stable bytes: keys sorted)."""
    sel, and_sel = _selector(namespace)
    panels = []
    for i, (title, unit, expr) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {
                        "refId": chr(ord("A") + j),
                        "expr": query.format(sel=sel, and_sel=and_sel),
                        "legendFormat": "__auto",
                    }
                    for j, query in enumerate(expr.split("\n"))
                ],
            }
        )
    doc = {
        "uid": DASHBOARD_UID,
        "title": f"slmguard fleet ({namespace})",
        "tags": ["slmguard"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "1m",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                }
            ]
        },
        "panels": panels,
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def dashboard_configmap(namespace: str) -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{APP}-dashboard",
            "namespace": namespace,
            "labels": Commented(
                {**_labels(), "grafana_dashboard": "1"},
                "grafana_dashboard: Grafana's sidecar loads ConfigMaps with this label.",
            ),
        },
        "data": {"slmguard.json": Literal(dashboard(namespace))},
    }
    return yamltext.dump(doc, "The fleet's Grafana dashboard (also slmguard-dashboard.json).")


def kustomization() -> str:
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["servicemonitor.yaml", "prometheusrule.yaml", "grafana-dashboard.yaml"],
    }
    return yamltext.dump(
        doc, "kubectl apply -k monitoring/ (needs the Prometheus Operator's CRDs)."
    )

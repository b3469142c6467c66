"""The memory governor of ``slmguard serve``: shed at the watermark, degrade instead of dying.

Modules, one concern each:

    signal     the memory signal: the service's cgroup working set against the
               effective limit, PSI and commit headroom -> MemorySnapshot (I/O edge)
    policy     pure decisions on snapshots: levels with hysteresis, the
               degradation ladder, admission by prediction
    events     transition log lines and plain counters a metrics layer exports
    runtime    the loop that samples, decides and drives the engine through a
               small protocol the server implements
    http       the admin routes (``POST /api/v1/context/trim``,
               ``GET /api/v1/governor``)
    metrics    the Prometheus collector over the counters and the last snapshot
    serving    installs the governor into the server (hooks, routes, metrics)

The session store it trims is the server's (``slmguard.serve.sessions``). Only
``http`` imports fastapi and only ``metrics`` imports prometheus_client; both
load when ``serving.install`` runs, never at import time.
"""

"""The memory governor of ``slmguard serve``: shed at the watermark, degrade instead of dying.

Modules, one concern each:

    signal     the memory signal: the service's cgroup working set against the
               effective limit, PSI and commit headroom -> MemorySnapshot (I/O edge)
    policy     pure decisions on snapshots: levels with hysteresis, the
               degradation ladder, admission by prediction
    sessions   the SQLite session store (history as prompt prefix, trim)
    events     transition log lines and plain counters a metrics layer exports
    runtime    the loop that samples, decides and drives the engine through a
               small protocol the server implements
    http       the admin routes (``POST /api/v1/context/trim``,
               ``GET /api/v1/governor``); the only module importing the web stack

Only ``http`` imports fastapi; nothing here imports llama_cpp or prometheus_client
(``events.register_prometheus`` imports the latter lazily when asked).
"""

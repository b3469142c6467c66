"""The memory governor of ``slmguard serve``: shed at the watermark, degrade instead of dying.

Pure policy and one runtime; the server (``slmguard.serve``) builds it, drives
it and asks it about every request. Modules, one concern each:

    signal     the memory signal: the service's cgroup working set against the
               effective limit, PSI and commit headroom -> MemorySnapshot (I/O edge)
    policy     pure decisions on snapshots: levels with hysteresis, the
               degradation ladder, the max_tokens cap, admission by prediction,
               the context verdict (in tokens of one slot)
    request    the RequestPolicy protocol the server asks per request, and
               NoPolicy (``--no-governor``)
    events     transition log lines and plain counters a metrics layer exports
    ladder     over several engines (a board): which model a step acts on, the
               lowest priority first on the way down (evict an idle on-demand
               one, shrink, park), the highest first on the way back (pure)
    board      the engines it drives: each model's state and measurements
               (GovernedModel), one model's RequestPolicy (ModelPolicy), and the
               small protocol the server implements for each (EngineControl)
    runtime    the loop that samples, decides and drives the engines through
               EngineControl; the Governor is the server's RequestPolicy (per
               model on a board: Governor.for_model) and its ResidencyPolicy
    metrics    the Prometheus collector over the counters and the last snapshot

The server implements ``EngineControl`` (``slmguard.serve.control``), hands
the governor its session store (``slmguard.serve.sessions``, seen here as the
``SessionTrim`` protocol) and serves its admin routes
(``POST /api/v1/context/trim``, ``GET /api/v1/governor``). Nothing here
imports the server; only ``metrics`` imports prometheus_client.
"""

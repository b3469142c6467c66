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
    leaks      pure: a process's private memory (RssAnon + RssShmem + VmSwap) against
               its settled baseline and the plan, per request; the planned bound;
               when to recycle the engine
    recycling  the leak check at run time: reads the engine's and the front's
               footprint, asks the server to recycle a leaking engine, keeps the evidence
    runtime    the loop that samples, decides and drives the engine through a
               small protocol the server implements (EngineControl); the
               Governor is the server's RequestPolicy
    metrics    the Prometheus collector over the counters and the last snapshot

The server implements ``EngineControl`` (``slmguard.serve.control``), hands
the governor its session store (``slmguard.serve.sessions``, seen here as the
``SessionTrim`` protocol) and serves its admin routes
(``POST /api/v1/context/trim``, ``GET /api/v1/governor``). Nothing here
imports the server; only ``metrics`` imports prometheus_client.
"""

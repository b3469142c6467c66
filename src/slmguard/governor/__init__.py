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
    thermal    heat as an input, pure: levels by the watched zones' room below
               their trip point (and the Pi firmware's flags), hysteresis, the
               slots, max_tokens cap and shedding of each level
    heat       the heat signal (zones and flags under a root) and state at run time
    events     transition log lines and plain counters a metrics layer exports
    leaks      pure: a process's private memory (RssAnon + RssShmem + VmSwap) against
               its settled baseline and the plan, per request; the planned bound;
               when to recycle the engine
    recycling  the leak check at run time: reads the engine's and the front's
               footprint, asks the server to recycle a leaking engine, keeps the evidence
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

"""The memory governor of ``slmguard serve``: shed at the watermark, degrade instead of dying.

Pure policy and one runtime; the server (``slmguard.serve``) builds it, drives it, asks
it about every request, implements its ``EngineControl`` (``serve.control``), hands it
the session store (as ``SessionTrim``) and serves its admin routes. Nothing here imports
the server; only ``metrics`` imports prometheus_client. Modules, one concern each:

    signal     the service's working set against the effective limit, PSI, commit
               headroom -> MemorySnapshot (I/O edge)
    policy     pure decisions: levels with hysteresis, the degradation ladder, the
               max_tokens cap, admission by prediction, the context verdict
    request    the RequestPolicy protocol the server asks per request; NoPolicy
    thermal    heat, pure: levels by the zones' room below their trip point (and the
               Pi's flags); each level's slots, max_tokens cap and shedding
    heat       the heat signal (zones and flags under a root) and state at run time
    events     transition log lines and plain counters
    leaks      pure: a process's private memory against its baseline and the plan;
               when to recycle the engine
    recycling  the leak check at run time: footprints read, a leaking engine recycled
    ladder     on a board: which model a step acts on (lowest priority first on the
               way down, highest first on the way back; pure)
    board      each model's state (GovernedModel), its RequestPolicy (ModelPolicy),
               and the protocol the server implements for each (EngineControl)
    runtime    the loop: sample, decide, drive the engines; the Governor is the
               server's RequestPolicy and ResidencyPolicy
    metrics    the Prometheus collector over the counters and the last snapshot
"""

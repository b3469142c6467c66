"""``slmguard watch``: the watchdog that sees OOM kills, pressure and leaks.

Modules, one concern each:

    config   the settings, declared once (type, default, help); the CLI derives
             its flags from them
    state    the persisted cursor (kmsg sequence number + boot id) and
             last-seen counters, written atomically
    sources  reads one :class:`~slmguard.watch.sources.Snapshot` through
             ``slmguard.host``: the cgroup's memory and events, PSI, fd and
             DMA-BUF counts, CMA, and the server's /health and governor
    client   the small HTTP/1.1 client for the server and webhooks
    rules    pure decisions on snapshots, one function per rule: alerts, trim,
             crash bundle, level
    alerts   delivery: JSON-lines log, webhook POST, command
    bundle   crash bundles under ``<state_dir>/crashes/`` within count/size limits
    daemon   the loop: kernel OOM reports since the cursor, then a snapshot,
             the rules and their actions (adaptive interval, wakes on new
             kernel records, clean SIGTERM)

Stdlib only: no numpy, gguf, fastapi or httpx on this path, so the watcher
stays small on a 4 GB board and runs where the server stack is not installed.
"""

"""``slmguard top``: the live view of a served model, its governor and its board.

Modules, one concern each:

    config    the settings, declared once (flags and SLMGUARD_TOP_* derive from them);
              where the admin token and the API key come from
    client    the four HTTP calls (/health, /metrics, /api/v1/governor, trim)
    promtext  a small Prometheus text-format reader
    server    /health + /metrics + governor status -> the server's snapshot (pure)
    sources   one refresh: the server, the board's files (through slmguard.host),
              the deltas between refreshes
    events    the timeline: watch's alerts.jsonl, crash bundles, what changed
    snapshot  the frozen model of one refresh, and its JSON form
    view      snapshot -> panes of fields, tables, bars and flags (pure)
    text      the plain-text and JSON printer (``--once``), stdlib only
    app       the terminal UI (the only module importing textual)

Only ``app`` needs the ``top`` extra (in a clone ``.venv/bin/pip install -e '.[top]'``);
everything else is the standard library plus slmguard, so ``top --once``
runs on a board where the UI library is not installed, and ``plan``,
``doctor``, ``render`` and ``apply`` never import any of it.
"""

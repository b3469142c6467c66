"""``slmguard bench``: the plan measured on this board, with the board's state beside it.

The same model runs 2-4x faster or slower on the same board with settings nobody sees;
a figure without the state it was measured in says little. The bench starts the real
engine as ``serve`` starts it (its supervisor, command line and environment, with the
plan's settings), measures prefill and decode at the planned context for one stream and
for every slot at once, the first token's time and the engine's peak memory against the
plan, and records beside the figures what ran (model sha256, plan hash, engine build and
CPU profile) and the board's state before and after (governors, clocks, devfreq, power
mode, temperatures, throttle flags, the load of the other processes). Modules:

    target    the plan, model and engine resolved as serve resolves them
    measure   the requests to the engine and their figures (pure over a transport)
    runner    one run: state, engine, measures, state
    record    the record (JSON), the load window, reading a record back
    report    the table for people, and two records side by side

Above ``serve`` (it starts serve's engine supervisor), beside ``top``; the CLI is
``commands/bench.py``.
"""

"""``slmguard bench``: measure a plan on this board, the board's state recorded beside it.

Exit status: 0 measured (or compared), 64 bad arguments, 65 the model cannot be used,
66 the model is missing, 69 no engine binary or no web stack (the serve extra), 70 the
engine died or restarted during the run, 78 a bad plan, a size that does not fit a slot,
or a file that is not a bench record (``--compare``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ORDER = 45

EXAMPLE = """\
Example:
  slmguard bench                               # this host's plan of the embedded model
  slmguard bench --plan plan.json --out run.json
  slmguard bench --plan plan.json --prompt-tokens 512 --decode-tokens 64
  slmguard bench --json > run.json             # the record for scripts
  slmguard bench --compare before.json         # run now, side by side with an old run
  slmguard bench --compare a.json b.json       # two runs, nothing measured

The engine is started as `slmguard serve` starts it, with the plan's settings; each
stream's prompt fills the planned slot unless --prompt-tokens says otherwise (a long
prefill on a big context: progress goes to stderr). The record holds what ran (model
sha256, plan hash, engine version and CPU profile) and the board's state before and after
(governors, clocks, devfreq, power mode, temperatures, throttle flags, other processes'
load). Exit status: 0, 64 usage, 65/66 model, 69 no engine or web stack, 70 the engine
died or restarted, 78 plan, sizes or a --compare file that is not a bench record.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="measure a plan on this board (prefill, decode, first token, peak memory) "
        "with the board's state",
        description="Measure a plan on this board with the real engine as serve starts it: "
        "prefill and decode tokens/s at the planned context for one stream and for every "
        "slot at once, the first token's time and the engine's peak memory against the "
        "plan, and beside them the state of the board.\n\n" + EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--plan", type=Path, help="plan file (default: serve's plan for this host)")
    p.add_argument("--llama-server", type=Path, help="the engine binary (default: serve's)")
    p.add_argument(
        "--prompt-tokens", type=int, help="prompt tokens per stream (default: fill the slot)"
    )
    p.add_argument(
        "--decode-tokens", type=int, default=128, help="tokens generated per stream (128)"
    )
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.add_argument("--out", type=Path, help="also write the record (JSON) to this file")
    p.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="one record: run now and compare with it; two: compare them, nothing run",
    )
    p.set_defaults(run=run)


def _progress(message: str) -> None:
    print(f"slmguard bench: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from slmguard.bench import record, report
    from slmguard.errors import UsageError

    compare = args.compare or []
    if len(compare) > 2:
        raise UsageError("--compare takes one record (run now and compare) or two")
    old = [record.load_record(p) for p in compare]  # checked before any engine starts
    if len(old) == 2:
        if args.plan or args.out or args.json:
            raise UsageError("--compare A B compares two records; it runs nothing")
        print(report.compare(old[0], old[1], (str(compare[0]), str(compare[1]))), end="")
        return 0
    new = _measure(args)
    if args.out is not None:
        from slmguard.atomicio import write_atomic

        write_atomic(args.out, record.dumps(new).encode())
    if args.json:
        print(record.dumps(new), end="")
    elif old:
        print(report.compare(old[0], new, (str(compare[0]), "this run")), end="")
    else:
        print(report.table(new), end="")
    return 0


def _measure(args: argparse.Namespace) -> dict[str, object]:
    from slmguard.bench.runner import BenchOptions, run
    from slmguard.bench.target import resolve_target
    from slmguard.errors import UsageError

    if args.decode_tokens < 1 or (args.prompt_tokens is not None and args.prompt_tokens < 1):
        raise UsageError("--prompt-tokens and --decode-tokens must be at least 1")
    _progress("resolving the plan, the model and the engine")
    target = resolve_target(args.plan, args.llama_server)
    opts = BenchOptions(prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens)
    return run(target, opts, _progress)

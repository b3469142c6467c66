"""``slmguard engine``: the llama-server builds installed, the one chosen for this CPU and
why, and ``--check PATH`` for a board's own build."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slmguard.engines import Probe, Selection

ORDER = 35

EXAMPLE = """\
Example:
  slmguard engine                      # the builds, the chosen one and why
  slmguard engine --json
  slmguard engine --check /opt/llama.cpp/build/bin/llama-server
  slmguard engine --check ./llama-server --model qwen2.5-0.5b-instruct-q4_k_m.gguf

serve runs the chosen build unless --llama-server or the plan names one. A build is
chosen from the package's (/usr/lib/slmguard/engines/<profile>/, each with its
build.json): the one needing the most CPU features this CPU has all of; else the one
`make` linked beside this Python; else the first llama-server on PATH.
--check runs the binary: its --version, the devices --list-devices finds, whether it
bounds a grammar's work per token (its --help lists --grammar-max-work: slmguard's
builds do; without it serve simulates the grammars' parse stacks, best effort), and
that it loads a model (default: the embedded default model, assembled when missing)
and decodes one token, which runs the CPU kernels a build for another CPU would die in.
The listing says the same of the chosen build.

A package build whose build.json is missing or invalid is listed with the problem and
never chosen.

Exit status: 0 a build is chosen (--check: it passed), 64 usage, 65 --model is not a
usable GGUF, 66 --model missing, 69 no build fits this CPU (--check: the binary does not
run, or does not start).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "engine",
        help="the llama-server builds installed and the one chosen for this CPU",
        description="List the llama-server builds installed (the package's CPU profiles, "
        "make's build, PATH), the CPU features read from this host, the build chosen and "
        "why; or check a build given by path.\n\n" + EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--check", type=Path, metavar="PATH", help="probe this llama-server binary instead"
    )
    p.add_argument("--model", type=Path, metavar="FILE", help="the GGUF --check starts it with")
    p.add_argument(
        "--no-start", action="store_true", help="--check without starting it (version, devices)"
    )
    p.add_argument(
        "--backend",
        default="cpu",
        metavar="NAME",
        help="the backend the build must have (cpu, vulkan, cuda; default cpu)",
    )
    p.add_argument(
        "--engines-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the package's builds are (default /usr/lib/slmguard/engines)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, metavar="S", help="--check's start time limit"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slmguard import engines
    from slmguard.errors import UsageError

    if args.check is None and (args.model or args.no_start):
        raise UsageError("--model and --no-start go with --check PATH")
    if not 1 <= args.timeout <= 3600:
        raise UsageError(f"--timeout {args.timeout}: need 1-3600 seconds")
    if args.check is not None:
        return _check(args)
    selection = engines.select_engine(args.engines_dir or engines.PACKAGE_DIR, backend=args.backend)
    bounded = engines.grammar_bound(selection.chosen.binary) if selection.chosen else None
    if args.json:
        print(json.dumps({**selection_json(selection), "grammar_bound": bounded}, indent=2))
    else:
        sys.stdout.write(selection_text(selection))
        if bounded is not None:
            print(f"grammar bound: {grammar_bound_text(bounded)}")
    _ = selection.binary  # EngineUnavailableError (69) with the reasons when nothing fits
    return 0


def grammar_bound_text(bounded: bool) -> str:
    if bounded:
        return "yes (--grammar-max-work: an ambiguous grammar is refused alone, 400)"
    return ("no (a build without slmguard's engine patch: serve simulates the grammars' "
            "parse stacks, best effort; docs/serve.md, 'Constrained decoding')")  # fmt: skip


def selection_json(selection: Selection) -> dict[str, Any]:
    from slmguard.engines import describe

    cpu = selection.cpu
    return {
        "cpu": {"arch": cpu.arch, "features": sorted(cpu.features), "source": cpu.source},
        "builds": [
            {**d, "fits": v.fits, "reason": v.reason}
            for d, v in zip(
                describe(v.build for v in selection.verdicts), selection.verdicts, strict=True
            )
        ],
        "chosen": str(selection.chosen.binary) if selection.chosen else None,
        "reason": selection.reason,
    }


def selection_text(selection: Selection) -> str:
    cpu = selection.cpu
    lines = [
        f"CPU: {cpu.arch}, {len(cpu.features)} features from {cpu.source}",
        "builds:" if selection.verdicts else "builds: none installed",
    ]
    for v in selection.verdicts:
        mark = "*" if v.build is selection.chosen else " "
        label = v.build.info.profile if v.build.info else "-"
        lines.append(f"{mark} {label:<8} {v.build.source:<7} {v.build.binary}")
        lines.append(f"    {'fits' if v.fits else 'no'}: {v.reason}")
    if selection.chosen is not None:
        lines.append(f"chosen: {selection.chosen.binary}")
    lines.append(f"why: {selection.reason}")
    return "\n".join(lines) + "\n"


def _check_model(args: argparse.Namespace) -> Path | None:
    if args.no_start:
        return None
    if args.model is not None:
        from slmguard.plan.modelfacts import read_model_facts

        read_model_facts(args.model)  # 65/66 with the reason before a minute of loading
        return Path(args.model)
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    return ensure_default_model(paths.model_dir())


def _check(args: argparse.Namespace) -> int:
    from slmguard.engines import probe
    from slmguard.errors import EngineUnavailableError
    from slmguard.host.cpu import usable_threads

    model = _check_model(args)
    if model is not None and not args.json:
        print(f"starting {args.check} with {model} (up to {args.timeout:.0f} s)", file=sys.stderr)
    result = probe(args.check, model, threads=usable_threads(), timeout_s=args.timeout)
    if args.json:
        print(json.dumps(probe_json(result), indent=2))
    else:
        sys.stdout.write(probe_text(result))
    if result.start is not None and not result.start.ok:
        raise EngineUnavailableError(
            f"a working engine at {args.check}", hint=f"it did not start: {result.start.detail}"
        )
    return 0


def probe_json(result: Probe) -> dict[str, Any]:
    start = result.start
    return {
        "binary": str(result.binary),
        "version": result.version,
        "devices": [{"name": d.name, "description": d.description} for d in result.devices],
        "backends": list(result.backends),
        "grammar_bound": result.grammar_bound,
        "start": None
        if start is None
        else {"ok": start.ok, "seconds": round(start.seconds, 1), "detail": start.detail},
    }


def probe_text(result: Probe) -> str:
    devices = ", ".join(f"{d.name} ({d.description})" for d in result.devices) or "none"
    lines = [
        f"binary: {result.binary}",
        f"version: {result.version.removeprefix('version:').strip()}",
        f"devices: {devices}",
        f"backends: {', '.join(result.backends)}",
        f"grammar bound: {grammar_bound_text(result.grammar_bound)}",
    ]
    start = result.start
    if start is None:
        lines.append("start: not checked (--no-start)")
    else:
        verdict = "ok" if start.ok else "FAILED"
        lines.append(f"start: {verdict} in {start.seconds:.1f} s: {start.detail}")
    return "\n".join(lines) + "\n"

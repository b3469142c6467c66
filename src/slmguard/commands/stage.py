"""``slmguard stage``: a board's half of a fleet rollout before apply (the Ansible role's step).

Checks first, writing nothing: that this is the slmguard the rollout was
rendered by (``--expect-version``) and that the board is the plan's kind
(doctor's ``board.hardware``: device tree, MemTotal, CPUs). Then stages the
plan and the model (:mod:`slmguard.deploy.stage`) and reports, with
``--json``, what it did and the deployment in place (its plan, the rollout
that made it, whether it passed the gate). ``--gate-passed`` records the
deployment in place as having passed the fleet's gate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slmguard.commands._deploy import copy_progress
from slmguard.errors import RefusedError, UsageError

if TYPE_CHECKING:
    from slmguard.plan.schema import Plan

ORDER = 33
RESULT_SCHEMA = "slmguard.stage-result/1"

_DESCRIPTION = (
    "Stage a plan and its model on this board for `slmguard apply` (what the fleet's "
    "Ansible role runs on each board before apply).\n\n"
    "Before anything is read from the network or written: --expect-version must be this "
    "slmguard's version, and the board must be the plan's kind (doctor's board.hardware: "
    "device tree, MemTotal, CPUs), else 78. Then the plan goes to STAGE/plan.json and the "
    "model to STAGE/models/SHA[:16]/NAME: kept while apply's stamp vouches for it (nothing "
    "read), else hashed once (streamed) and deleted when its bytes are wrong; taken from a "
    "file on the board with that sha256 (a hard link); or downloaded from --model-url "
    "(resumed from a partial file, retried --retries times with growing pauses, hashed as "
    "it arrives, 69 when the tries run out). Without --model-url a model not on the board "
    "is reported missing (exit 0): copy it there, then stage again. A board plan's other "
    "models and its vision projector (--file-name/--file-size/--file-sha256/--file-url, "
    "one each a file) are staged the same way, beside the model. Files of other plans "
    "leave the staging directory. --check does the checks only.\n\n"
    "--gate-passed records the deployment in place (apply's manifest: generation, plan, "
    "rollout) as having passed the fleet's gate; `stage --json` reports whether the "
    "deployment in place has.\n\n"
    "Example:\n"
    "  slmguard stage --plan - --model-name m.gguf --model-size 253113024 \\\n"
    "      --model-sha256 HEX --model-url https://mirror.example/models/m.gguf --json < plan.json\n"
    "  slmguard stage --gate-passed"
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Not from deploy.stage: its download imports urllib.request (ssl, email), and every
    # verb registers at start, watch's included (test_watch_imports_no_heavy_dependency).
    from slmguard.paths import STAGE_DIR

    p = sub.add_parser(
        "stage",
        help="check the board's kind, then stage a plan and its model for apply (fleet rollouts)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--root", type=Path, default=Path("/"), metavar="DIR", help="target root")
    p.add_argument(
        "--stage-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"the staging directory (default: ROOT{STAGE_DIR})",
    )
    p.add_argument("--plan", default=None, metavar="FILE", help="the plan; - reads it from stdin")
    p.add_argument("--model-name", default=None, metavar="NAME", help="the model's file name")
    p.add_argument("--model-size", type=int, default=None, metavar="BYTES")
    p.add_argument("--model-sha256", default=None, metavar="HEX")
    p.add_argument("--model-url", default=None, metavar="URL", help="the mirror's URL of it")
    files = p.add_argument_group(
        "the plan's other files",
        "a board's other models and its vision projector, each staged like the model: "
        "--file-name, --file-size and --file-sha256 once a file (repeated, in the same order), "
        "--file-url for every file or for none",
    )
    files.add_argument("--file-name", action="append", default=[], metavar="NAME")
    files.add_argument("--file-size", action="append", type=int, default=[], metavar="BYTES")
    files.add_argument("--file-sha256", action="append", default=[], metavar="HEX")
    files.add_argument("--file-url", action="append", default=[], metavar="URL")
    p.add_argument("--expect-version", default=None, metavar="V", help="refuse another slmguard")
    p.add_argument("--retries", type=int, default=5, help="tries after the first (default 5)")
    p.add_argument(
        "--timeout", type=float, default=60.0, help="seconds per connect and read (default 60)"
    )
    p.add_argument("--verify", action="store_true", help="hash a stamped staged model anyway")
    p.add_argument("--check", action="store_true", help="the checks only: write nothing")
    p.add_argument(
        "--gate-passed",
        action="store_true",
        help="record the deployment in place as having passed the gate, and stop",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _stage_dir(args: argparse.Namespace) -> Path:
    from slmguard.paths import STAGE_DIR

    if args.stage_dir is not None:
        if not args.stage_dir.is_absolute():
            raise UsageError(f"--stage-dir {args.stage_dir}: must be an absolute path")
        return Path(args.stage_dir)
    root: Path = args.root
    return root / STAGE_DIR.lstrip("/")


def _read_plan(arg: str | None) -> tuple[Plan, bytes]:
    from slmguard.plan.planfile import MAX_PLAN_FILE_BYTES, load_plan, loads_plan

    if arg is None:
        raise UsageError("--plan FILE (or - for stdin) is needed to stage")
    if arg != "-":
        path = Path(arg)
        return load_plan(path), path.read_bytes()
    raw = sys.stdin.buffer.read(MAX_PLAN_FILE_BYTES + 1)
    if len(raw) > MAX_PLAN_FILE_BYTES:
        raise UsageError(f"--plan -: more than {MAX_PLAN_FILE_BYTES} bytes on stdin")
    return loads_plan(raw, "<stdin>"), raw


def _check_version(expected: str | None) -> None:
    from slmguard import __version__

    if expected is not None and expected != __version__:
        raise RefusedError(
            f"this board runs slmguard {__version__}; the rollout was rendered by slmguard "
            f"{expected}: install that version (apply renders the files on the board, so the "
            "same version writes the same bytes)",
            facts={"version": __version__, "expected": expected},
        )


def _check_kind(root: Path, plan: Plan) -> dict[str, Any]:
    """doctor's board.hardware on this root: refused (78) when it fails."""
    from slmguard.doctor.devices import check_board_hardware
    from slmguard.host.snapshot import collect

    finding = check_board_hardware(collect(root), plan)
    if finding.severity == "fail":
        raise RefusedError(
            f"this board is not a {plan.board.name}: {finding.summary} (nothing staged; move "
            "it to its kind's group in the inventory)",
            facts={"board": plan.board.name},
        )
    return {"severity": finding.severity, "summary": finding.summary}


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    try:
        out = _run(args)
    except BaseException as err:
        if args.json:
            print(json.dumps(_failure(err), indent=1), flush=True)
        raise
    out["seconds"] = round(time.monotonic() - t0, 3)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        _print_lines(out)
    return 0


def _failure(err: BaseException) -> dict[str, Any]:
    from slmguard.errors import SlmguardError, exit_code

    code = exit_code(err) if isinstance(err, SlmguardError) else 1
    message = err.message if isinstance(err, SlmguardError) else f"{type(err).__name__}: {err}"
    return {"schema": RESULT_SCHEMA, "exit": code, "error": message}


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from slmguard.deploy.digests import load_digests
    from slmguard.deploy.manifest import load_manifest
    from slmguard.deploy.rootpath import check_root
    from slmguard.deploy.stage import deployment_record, gated, record_gate

    check_root(args.root)
    stage_dir = _stage_dir(args)
    if args.gate_passed:
        recorded = record_gate(stage_dir, load_manifest(args.root))
        return {"schema": RESULT_SCHEMA, "exit": 0, "changed": recorded, "gate_recorded": True}
    _check_version(args.expect_version)
    plan, text = _read_plan(args.plan)
    want = _wanted(args)
    others = _wanted_files(args)
    kind = _check_kind(args.root, plan)
    manifest = load_manifest(args.root)
    out: dict[str, Any] = {
        "schema": RESULT_SCHEMA,
        "exit": 0,
        "kind": kind,
        "deployment": deployment_record(manifest),
        "gated": gated(stage_dir, manifest),
        "check": args.check,
    }
    if args.check:
        return {**out, "changed": False}
    written = _write_plan(stage_dir, text)
    if want is None and not others:
        return {
            **out, "changed": written, "plan_written": written, "model": None, "files": [],
            "pruned": [],
        }  # fmt: skip
    from slmguard.deploy.stage import prune_models

    digests = load_digests(args.root)
    model = None if want is None else _stage_model(args, stage_dir, want, digests, args.model_url)
    files = [_stage_model(args, stage_dir, w, digests, url) for w, url in others]
    pruned = prune_models(stage_dir, [*([] if want is None else [want]), *(w for w, _ in others)])
    digests.save(create=True)
    moved = [m["how"] for m in (*([] if model is None else [model]), *files)]
    changed = written or any(how not in ("kept", "verified") for how in moved) or bool(pruned)
    return {
        **out, "changed": changed, "plan_written": written, "model": model, "files": files,
        "pruned": pruned,
    }  # fmt: skip


def _wanted(args: argparse.Namespace) -> Any:
    from slmguard.deploy.stage import WantedModel

    given = [a is not None for a in (args.model_name, args.model_size, args.model_sha256)]
    if not any(given):
        if args.model_url is not None:
            raise UsageError("--model-url needs --model-name, --model-size and --model-sha256")
        return None  # a model already on the board: apply checks it
    if not all(given):
        raise UsageError("--model-name, --model-size and --model-sha256 go together")
    if args.model_url is not None:
        _check_url("--model-url", args.model_url)
    _check_tries(args)
    return WantedModel(args.model_name, args.model_size, args.model_sha256)


def _check_url(flag: str, text: str) -> None:
    import urllib.parse

    url = urllib.parse.urlsplit(text)
    if (
        url.scheme not in ("http", "https")
        or not url.hostname
        or url.username is not None
        or any(c.isspace() or not c.isprintable() for c in text)
    ):
        raise UsageError(
            f"{flag} {text[:200]!r}: need an http:// or https:// URL (no credentials or spaces)"
        )


def _check_tries(args: argparse.Namespace) -> None:
    if not 0 <= args.retries <= 100 or not 1 <= args.timeout <= 3600:
        raise UsageError("--retries 0..100, --timeout 1..3600 seconds")


#: The most files a plan stages beside its model (a board's models and a projector).
MAX_FILES = 64


def _wanted_files(args: argparse.Namespace) -> list[tuple[Any, str | None]]:
    """The plan's other files (``--file-*``, one each a file), with their URLs or None."""
    from slmguard.deploy.stage import WantedModel

    names, sizes, digests, urls = args.file_name, args.file_size, args.file_sha256, args.file_url
    if not len(names) == len(sizes) == len(digests) or len(urls) not in (0, len(names)):
        raise UsageError(
            "--file-name, --file-size and --file-sha256 go together, once a file (and "
            "--file-url for every file or for none)"
        )
    if len(names) > MAX_FILES:
        raise UsageError(f"at most {MAX_FILES} files beside the model (--file-name)")
    for url in urls:
        _check_url("--file-url", url)
    if names:
        _check_tries(args)
    return [
        (WantedModel(n, size, sha, flag="--file"), urls[i] if urls else None)
        for i, (n, size, sha) in enumerate(zip(names, sizes, digests, strict=True))
    ]


def _write_plan(stage_dir: Path, text: bytes) -> bool:
    from slmguard.deploy.stage import write_plan

    return write_plan(stage_dir, text)


def _stage_model(
    args: argparse.Namespace, stage_dir: Path, want: Any, digests: Any, url: str | None
) -> dict[str, Any]:
    from slmguard.deploy.download import Retry
    from slmguard.deploy.stage import stage_model

    staged = stage_model(
        stage_dir,
        want,
        digests,
        url=url,
        retry=Retry(retries=args.retries, timeout_s=args.timeout),
        verify=args.verify,
        progress=copy_progress(f"downloading {want.name}"),
    )
    return {
        "path": str(staged.path),
        "how": staged.how,
        "read_bytes": staged.read_bytes,
        "downloaded_bytes": staged.downloaded_bytes,
        "resumed_bytes": staged.resumed_bytes,
        "attempts": staged.attempts,
        "discarded_wrong_bytes": staged.discarded,
    }


def _print_lines(out: dict[str, Any]) -> None:
    if out.get("gate_recorded"):
        print("gate recorded" if out["changed"] else "gate already recorded (or no deployment)")
        return
    print(f"board kind: {out['kind']['summary']}")
    if out["check"]:
        return
    print("plan staged" if out["plan_written"] else "plan already staged")
    model = out["model"]
    if model is None:
        print("model: given (apply checks it)")
    else:
        print(
            f"model {model['how']}: {model['path']} ({model['downloaded_bytes']} bytes downloaded)"
        )
    for f in out.get("files", []):
        print(f"file {f['how']}: {f['path']} ({f['downloaded_bytes']} bytes downloaded)")
    for path in out["pruned"]:
        print(f"removed {path}")

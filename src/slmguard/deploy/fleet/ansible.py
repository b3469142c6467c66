"""An Ansible role, inventory and playbooks that roll a plan out to a fleet of boards.

Owns ``render --target ansible``. The role's tasks and handlers, the
playbooks and the settings are fixed files, shipped as package data in
``ansible_tree/`` (read them there: they are the role as Ansible runs it);
only what depends on the plans is generated here: the inventory, the group
vars and the role's defaults (the paths of :mod:`slmguard.deploy.units`),
pure text from the plans (each with its model, checked on the controller by
:mod:`slmguard.deploy.modelfile`). Written for ansible-core with
``ansible.builtin`` modules only (no collection to download) and checked by
``ansible-lint``.

**One source of truth for the bytes.** The role does not carry the rendered
units, sysctl or boot edits: it copies the plan (and the model, unless it is
already on the board) and runs ``slmguard apply`` on the board, which renders
them there with the renderers of :mod:`slmguard.deploy.render`. Three reasons:
the edits of ``/etc/fstab`` and the boot file depend on what the board holds
(only apply reads them, under its root); ``slmguard rollback`` restores only
what apply recorded in its manifest, so files put there by Ansible's ``copy``
could never be rolled back byte for byte; and two copies of the bytes (role
templates and renderers) would drift. The role checks that the board's
slmguard is the version that rendered it, so the bytes are the ones
``render`` shows for that version.

What the tree holds:

- ``inventory/hosts.yml``: one group per board kind (``slmguard_<slug>``,
  :mod:`slmguard.deploy.fleet.kinds`) under ``slmguard``, and
  ``inventory/group_vars/<group>.yml``: that kind's plan
  (``plans/<slug>.json``), its model (a file on the controller to copy, or
  ``slmguard_model_file`` on the board), the start-up allowance
  (:mod:`slmguard.deploy.fleet.startup`);
- ``site.yml`` (deploy) and ``rollback.yml``; ``roles/slmguard``: audit with
  ``slmguard doctor --plan`` before, ``slmguard apply``, handlers that restart
  only the services whose files apply changed, start the services, wait for
  ``/health`` to answer 200 with the planned model's sha256, ``doctor``
  again. A second run changes nothing (apply says "nothing to change").
  The admin token is created by apply on the board, never in the inventory.
  ``--check`` runs ``apply --dry-run`` and reports what would change.

Every plan string in the tree is written with Ansible's ``!unsafe`` tag (never
templated) through :mod:`slmguard.deploy.fleet.yamltext` (never syntax).
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import PurePosixPath

from slmguard import __version__
from slmguard.deploy import escape
from slmguard.deploy.fleet import yamltext
from slmguard.deploy.fleet.kinds import BoardPlan
from slmguard.deploy.fleet.startup import timing
from slmguard.deploy.fleet.yamltext import Commented, Unsafe
from slmguard.deploy.manifest import MANIFEST_DEST
from slmguard.deploy.render import RenderedFile
from slmguard.deploy.units import (
    ADMIN_TOKEN_PATH,
    CRASHDUMP_SERVICE,
    INFERENCE_SLICE,
    PLAN_PATH,
    PROTECT_DROPIN,
    SERVER_URL,
    SERVICE,
    UNIT_DIR,
    WATCH_SERVICE,
)
from slmguard.plan.schema import dumps_plan

#: The role's fixed files (package data), at their paths in the rendered tree.
TREE = "ansible_tree"
#: Files of the fixed tree written as they are; the others are YAML and get the header.
VERBATIM = ("ansible.cfg",)
#: ansible-lint allows 160 characters a line; long Jinja expressions are split below it.
LINE_WIDTH = 150
ROLE = "slmguard"
ROLE_DIR = f"/roles/{ROLE}"
#: Where the role stages the plan and a copied model on the board (removed by rollback).
STAGE_DIR = "/var/lib/slmguard-fleet"
#: Files whose change means the server must restart (the model is named by the plan).
SERVER_FILES = (
    f"{UNIT_DIR}/{SERVICE}",
    f"{UNIT_DIR}/{INFERENCE_SLICE}",
    PLAN_PATH,
    ADMIN_TOKEN_PATH,
)
WATCH_FILES = (f"{UNIT_DIR}/{WATCH_SERVICE}", PLAN_PATH, ADMIN_TOKEN_PATH)
HEADER = (
    "Rendered by slmguard {version} (render --target ansible). The board runs `slmguard apply`\n"
    "itself: this tree holds the plans, not the rendered files."
)


def _doc(value: object, what: str = "") -> bytes:
    header = HEADER.format(version=__version__) + (f"\n{what}" if what else "")
    return yamltext.dump(value, header, width=LINE_WIDTH).encode()


def _root_path(path: str) -> str:
    """A Jinja expression for ``path`` under the role's root (``/`` on a board)."""
    return "{{ (slmguard_root ~ '/" + path.lstrip("/") + "') | regex_replace('^//', '/') }}"


def defaults() -> dict[str, object]:
    return {
        "slmguard_version": Commented(
            __version__, "The slmguard that rendered this role; the board must run the same."
        ),
        "slmguard_exec": Commented(
            "/usr/local/bin/slmguard", "slmguard on the board (installed with its [serve] extra)."
        ),
        "slmguard_root": Commented("/", "The target root; not / (an image) writes files only."),
        "slmguard_stage_dir": Commented(
            _root_path(STAGE_DIR), "The plan and a copied model wait here (rollback removes it)."
        ),
        "slmguard_plan": Commented("", "The plan on the controller (set per board group)."),
        "slmguard_board": Commented("", "The plan's board name (set per board group)."),
        "slmguard_model_src": Commented(
            "", "A GGUF on the controller, copied to the board (set per board group)."
        ),
        "slmguard_model_name": "model.gguf",
        "slmguard_model_file": Commented(
            "", "A GGUF already on the board: used instead of copying slmguard_model_src."
        ),
        "slmguard_protect": Commented([], "Services to move into the business slice."),
        "slmguard_business_slice": "business.slice",
        "slmguard_restart_protected": Commented(
            True, "Restart a protected service when its drop-in changes (that moves it)."
        ),
        "slmguard_start": Commented(True, "Start the services and wait for the model to serve."),
        "slmguard_services": [SERVICE, WATCH_SERVICE],
        "slmguard_units": [SERVICE, WATCH_SERVICE, CRASHDUMP_SERVICE],
        "slmguard_ready_timeout_s": Commented(
            300, "How long to wait for /health 200 (set per board group from the plan)."
        ),
        "slmguard_health_url": f"{SERVER_URL}/health",
        "slmguard_doctor_max_exit": Commented(
            1, "doctor after the deployment: 0 pass, 1 warnings, 2 failures."
        ),
        "slmguard_server_files": list(SERVER_FILES),
        "slmguard_watch_files": list(WATCH_FILES),
        "slmguard_protect_dropin": PROTECT_DROPIN,
        "slmguard_unit_dir": UNIT_DIR,
        "slmguard_apply_manifest": MANIFEST_DEST,
        "slmguard_installed_plan": PLAN_PATH,
    }


def inventory(bps: tuple[BoardPlan, ...]) -> dict[str, object]:
    groups: dict[str, object] = {}
    for bp in bps:
        groups[bp.group] = Commented(
            {"hosts": {}},
            f"Boards of kind {bp.slug}: add each as `name: {{ansible_host: ADDRESS}}`.",
        )
    return {"all": {"children": {"slmguard": {"children": groups}}}}


def group_vars(bp: BoardPlan) -> dict[str, object]:
    t = timing(bp.plan)
    name = escape.file_name(PurePosixPath(str(bp.model.source)).name)
    return {
        "slmguard_board": Commented(Unsafe(bp.plan.board.name), "The plan's board name."),
        "slmguard_plan": Commented(
            f"{{{{ playbook_dir }}}}/plans/{bp.slug}.json", "This board kind's plan."
        ),
        "slmguard_model_src": Commented(
            Unsafe(str(bp.model.source)),
            f"The model on the controller: {bp.model.size_bytes} bytes, sha256 "
            f"{bp.model.sha256} (apply checks it on the board).",
        ),
        "slmguard_model_name": Unsafe(name),
        "slmguard_ready_timeout_s": Commented(t.startup_allowance_s, t.why_startup + "."),
    }


def _fixed(node: Traversable, rel: str) -> list[tuple[str, bytes]]:
    """(path in the tree, bytes) of every file under ``node``, in name order."""
    out: list[tuple[str, bytes]] = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
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


def render_tree(bps: tuple[BoardPlan, ...]) -> tuple[RenderedFile, ...]:
    """Every file of ``render --target ansible``, at paths relative to the output directory."""

    def f(path: str, content: bytes, why: str) -> RenderedFile:
        return RenderedFile(path, content=content, why=why)

    files = [
        *fixed_files(),
        f("/inventory/hosts.yml", _doc(inventory(bps)), "one group per board kind"),
        f(f"{ROLE_DIR}/defaults/main.yml", _doc(defaults()), "role defaults"),
    ]
    for bp in bps:
        files += [
            f(f"/plans/{bp.slug}.json", dumps_plan(bp.plan).encode(), f"plan for {bp.slug}"),
            f(
                f"/inventory/group_vars/{bp.group}.yml",
                _doc(group_vars(bp), f"Board kind {bp.slug}."),
                f"vars of {bp.group}",
            ),
        ]
    return tuple(files)

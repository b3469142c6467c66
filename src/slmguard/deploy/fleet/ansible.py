"""An Ansible role, inventory and playbooks that roll a plan out to a fleet of boards.

Owns ``render --target ansible``: pure text from the plans (each with its
model, checked on the controller by :mod:`slmguard.deploy.modelfile`). Written
for ansible-core with ``ansible.builtin`` modules only (no collection to
download) and checked by ``ansible-lint``.

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
#: A line of apply's output naming a changed path: "created /etc/...", "replaced ...".
CHANGED_LINE = r"^(?:created|replaced|removed) (/[^ ]*).*$"
HEADER = (
    "Rendered by slmguard {version} (render --target ansible). The board runs `slmguard apply`\n"
    "itself: this tree holds the plans, not the rendered files."
)


def _doc(value: object, what: str = "") -> bytes:
    header = HEADER.format(version=__version__) + (f"\n{what}" if what else "")
    return yamltext.dump(value, header, width=LINE_WIDTH).encode()


def _argv(*words: str) -> list[str]:
    return list(words)


def _root_path(path: str) -> str:
    """A Jinja expression for ``path`` under the role's root (``/`` on a board)."""
    return "{{ (slmguard_root ~ '/" + path.lstrip("/") + "') | regex_replace('^//', '/') }}"


ON_BOARD = "slmguard_start | bool and slmguard_root == '/' and not ansible_check_mode"


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


def _apply_argv(*extra: str) -> str:
    """The argv of ``slmguard apply`` as a Jinja list (every word a separate argument)."""
    words = ", ".join(f"'{w}'" for w in extra)
    tail = f" + [{words}]" if extra else ""
    return (
        "{{ [slmguard_exec, 'apply', '--plan', slmguard_plan_on_board, "
        "'--model', slmguard_model_path, '--root', slmguard_root, "
        "'--business-slice', slmguard_business_slice] + "
        "(slmguard_protect | map('regex_replace', '^', '--protect=') | list)" + tail + " }}"
    )


def _preflight_tasks() -> list[object]:
    """Check the board runs the slmguard that rendered the role and its group names a plan."""
    return [
        {
            "name": "Read the version of slmguard on the board",
            "ansible.builtin.command": {"argv": ["{{ slmguard_exec }}", "--version"]},
            "register": "slmguard_installed",
            "changed_when": False,
            "check_mode": False,
        },
        {
            "name": "Check it is the slmguard that rendered this role",
            "ansible.builtin.assert": {
                "that": ["slmguard_installed.stdout.split() | last == slmguard_version"],
                "fail_msg": "{{ slmguard_exec }} is {{ slmguard_installed.stdout }}; this role "
                "was rendered by slmguard {{ slmguard_version }}: install that version (apply "
                "renders the files on the board)",
                "quiet": True,
            },
        },
        {
            "name": "Check the board group names a plan and a model",
            "ansible.builtin.assert": {
                "that": [
                    "slmguard_plan | length > 0",
                    "slmguard_model_file | length > 0 or slmguard_model_src | length > 0",
                ],
                "fail_msg": "set slmguard_plan and slmguard_model_src (or slmguard_model_file) "
                "for this host's board group",
                "quiet": True,
            },
        },
    ]


def _staging_tasks() -> list[object]:
    """Copy the plan and (unless it is already on the board) the model to the staging directory."""
    staged_model = "{{ slmguard_stage_dir }}/models/{{ slmguard_model_name }}"
    return [
        {
            "name": "Create the staging directories",
            "ansible.builtin.file": {
                "path": "{{ item }}",
                "state": "directory",
                "owner": "root",
                "group": "root",
                "mode": "0755",
            },
            "loop": ["{{ slmguard_stage_dir }}", "{{ slmguard_stage_dir }}/models"],
        },
        {
            "name": "Stage the plan",
            "ansible.builtin.copy": {
                "src": "{{ slmguard_plan }}",
                "dest": "{{ slmguard_stage_dir }}/plan.json",
                "owner": "root",
                "group": "root",
                "mode": "0644",
            },
        },
        {
            "name": "Stage the model from the controller",
            "ansible.builtin.copy": {
                "src": "{{ slmguard_model_src }}",
                "dest": staged_model,
                "owner": "root",
                "group": "root",
                "mode": "0644",
            },
            "when": "slmguard_model_file | length == 0",
        },
        {
            "name": "Choose the model apply installs",
            "ansible.builtin.set_fact": {
                "slmguard_model_path": "{{ slmguard_model_file if slmguard_model_file | length "
                "> 0 else slmguard_stage_dir ~ '/models/' ~ slmguard_model_name }}"
            },
        },
    ]


def _check_mode_plan_tasks() -> list[object]:
    """In check mode, hand apply a temporary copy of the plan (nothing is staged)."""
    return [
        {
            "name": "Copy the plan to a temporary file (check mode: nothing is staged)",
            "ansible.builtin.tempfile": {"state": "file", "suffix": ".plan.json"},
            "register": "slmguard_check_plan",
            "changed_when": False,
            "check_mode": False,
            "when": "ansible_check_mode",
        },
        {
            "name": "Fill the temporary plan",
            "ansible.builtin.copy": {
                "src": "{{ slmguard_plan }}",
                "dest": "{{ slmguard_check_plan.path }}",
                "mode": "0600",
            },
            "changed_when": False,
            "check_mode": False,
            "when": "ansible_check_mode",
        },
        {
            "name": "Choose the plan apply reads",
            "ansible.builtin.set_fact": {
                "slmguard_plan_on_board": "{{ slmguard_check_plan.path if ansible_check_mode "
                "else slmguard_stage_dir ~ '/plan.json' }}"
            },
        },
    ]


def _audit_before_tasks() -> list[object]:
    """``slmguard doctor`` on the board before the deployment, and its verdict."""
    return [
        {
            "name": "Audit the board before the deployment",
            "ansible.builtin.command": {
                "argv": [
                    "{{ slmguard_exec }}",
                    "doctor",
                    "--plan",
                    "{{ slmguard_plan_on_board }}",
                    "--root",
                    "{{ slmguard_root }}",
                ]
            },
            "register": "slmguard_doctor_before",
            "changed_when": False,
            "failed_when": "slmguard_doctor_before.rc not in [0, 1, 2]",
            "check_mode": False,
        },
        {
            "name": "Show the audit before the deployment",
            "ansible.builtin.debug": {
                "msg": "doctor before, {{ slmguard_board }} plan: exit "
                "{{ slmguard_doctor_before.rc }} "
                "({{ slmguard_doctor_before.stdout_lines | last | default('') }})"
            },
        },
    ]


def _apply_tasks() -> list[object]:
    """``slmguard apply``, or in check mode its ``--dry-run`` (or why it cannot run yet)."""
    return [
        {
            "name": "Apply the plan",
            "ansible.builtin.command": {"argv": _apply_argv()},
            "register": "slmguard_apply",
            "changed_when": "'nothing to change' not in slmguard_apply.stdout",
            "when": "not ansible_check_mode",
            "notify": [
                "Restart the model server",
                "Restart the watcher",
                "Restart the protected services",
            ],
        },
        {
            "name": "Look for the model on the board (check mode)",
            "ansible.builtin.stat": {
                "path": "{{ slmguard_model_path }}",
                "get_checksum": False,
            },
            "register": "slmguard_check_model",
            "check_mode": False,
            "when": "ansible_check_mode",
        },
        {
            "name": "Show what apply would change",
            "ansible.builtin.command": {"argv": _apply_argv("--dry-run")},
            "register": "slmguard_dry_run",
            "changed_when": "'nothing to change' not in slmguard_dry_run.stdout",
            "check_mode": False,
            "when": "ansible_check_mode and slmguard_check_model.stat.exists",
        },
        {
            "name": "Say the model would be copied first",
            "ansible.builtin.debug": {
                "msg": "{{ slmguard_model_path }} is not on the board yet: a run "
                "copies it and deploys"
            },
            "changed_when": True,
            "when": "ansible_check_mode and not slmguard_check_model.stat.exists",
        },
    ]


def _deploy_block() -> dict[str, object]:
    """The audit and apply (or dry run), removing the check-mode plan whatever happens."""
    return {
        "name": "Audit, apply, or show what apply would change",
        "block": [*_audit_before_tasks(), *_apply_tasks()],
        "always": [
            {
                "name": "Remove the temporary plan",
                "ansible.builtin.file": {
                    "path": "{{ slmguard_check_plan.path }}",
                    "state": "absent",
                },
                "changed_when": False,
                "check_mode": False,
                "when": "ansible_check_mode",
            },
        ],
    }


def _restart_tasks() -> list[object]:
    """Note the paths apply changed and run the handlers that restart their services."""
    return [
        {
            "name": "Note the paths apply changed",
            "ansible.builtin.set_fact": {
                "slmguard_changed": "{{ (slmguard_apply.stdout_lines | default([])) | "
                f"select('match', '{CHANGED_LINE}') | "
                f"map('regex_replace', '{CHANGED_LINE}', '\\1') | list }}}}"
            },
        },
        {"name": "Restart what changed", "ansible.builtin.meta": "flush_handlers"},
    ]


def _serving_tasks() -> list[object]:
    """Start the services and check the server serves the planned model."""
    return [
        {
            "name": "Start the services",
            "ansible.builtin.systemd_service": {"name": "{{ item }}", "state": "started"},
            "loop": "{{ slmguard_services }}",
            "when": ON_BOARD,
        },
        {
            "name": "Wait for the server to serve",
            "ansible.builtin.uri": {
                "url": "{{ slmguard_health_url }}",
                "status_code": 200,
                "return_content": True,
            },
            "register": "slmguard_health",
            "until": "slmguard_health.status == 200",
            "retries": "{{ (slmguard_ready_timeout_s | int) // 5 }}",
            "delay": 5,
            "when": ON_BOARD,
        },
        {
            "name": "Read the installed plan",
            "ansible.builtin.slurp": {"src": _root_path(PLAN_PATH)},
            "register": "slmguard_installed_plan_file",
            "when": "not ansible_check_mode",
        },
        {
            "name": "Check the server serves the planned model",
            "ansible.builtin.assert": {
                "that": [
                    "slmguard_health.json.model_sha256 == "
                    "(slmguard_installed_plan_file.content | b64decode | from_json).model.sha256",
                    "slmguard_health.json.model_path == "
                    "(slmguard_installed_plan_file.content | b64decode | from_json).model.path",
                ],
                "fail_msg": "the server serves {{ slmguard_health.json.model_path }}, not the "
                "planned model",
                "quiet": True,
            },
            "when": ON_BOARD,
        },
    ]


def _audit_after_tasks() -> list[object]:
    """``slmguard doctor`` on the board after the deployment, against the installed plan."""
    return [
        {
            "name": "Audit the board after the deployment",
            "ansible.builtin.command": {
                "argv": [
                    "{{ slmguard_exec }}",
                    "doctor",
                    "--plan",
                    _root_path(PLAN_PATH),
                    "--root",
                    "{{ slmguard_root }}",
                ]
            },
            "register": "slmguard_doctor_after",
            "changed_when": False,
            "failed_when": "slmguard_doctor_after.rc > (slmguard_doctor_max_exit | int)",
            "when": "not ansible_check_mode",
        },
    ]


def tasks() -> list[object]:
    return [
        *_preflight_tasks(),
        *_staging_tasks(),
        *_check_mode_plan_tasks(),
        _deploy_block(),
        *_restart_tasks(),
        *_serving_tasks(),
        *_audit_after_tasks(),
    ]


def _changed(files_var: str) -> str:
    return f"slmguard_changed | default([]) | intersect({files_var}) | length > 0"


def handlers() -> list[object]:
    return [
        {
            "name": "Restart the model server",
            "ansible.builtin.systemd_service": {
                "name": SERVICE,
                "state": "restarted",
                "daemon_reload": True,
            },
            "when": f"{ON_BOARD} and {_changed('slmguard_server_files')}",
        },
        {
            "name": "Restart the watcher",
            "ansible.builtin.systemd_service": {
                "name": WATCH_SERVICE,
                "state": "restarted",
                "daemon_reload": True,
            },
            "when": f"{ON_BOARD} and {_changed('slmguard_watch_files')}",
        },
        {
            "name": "Restart the protected services",
            "ansible.builtin.systemd_service": {
                "name": "{{ item }}",
                "state": "restarted",
                "daemon_reload": True,
            },
            "loop": "{{ slmguard_protect }}",
            "when": "slmguard_restart_protected | bool and slmguard_root == '/' and "
            "(slmguard_unit_dir ~ '/' ~ item ~ '.d/' ~ slmguard_protect_dropin) in "
            "(slmguard_changed | default([]))",
        },
    ]


def rollback_tasks() -> list[object]:
    return [
        {
            "name": "Look for the apply manifest",
            "ansible.builtin.stat": {"path": _root_path(MANIFEST_DEST)},
            "register": "slmguard_manifest",
        },
        {
            "name": "Look for the units",
            "ansible.builtin.stat": {"path": "{{ slmguard_unit_dir }}/{{ item }}"},
            "loop": "{{ slmguard_units }}",
            "register": "slmguard_unit_files",
            "when": "slmguard_manifest.stat.exists and slmguard_root == '/'",
        },
        {
            "name": "Stop the services",
            "ansible.builtin.systemd_service": {"name": "{{ item.item }}", "state": "stopped"},
            "loop": "{{ slmguard_unit_files.results | default([]) }}",
            "loop_control": {"label": "{{ item.item }}"},
            "when": "item.stat is defined and item.stat.exists",
        },
        {
            "name": "Roll back what apply changed",
            "ansible.builtin.command": {
                "argv": ["{{ slmguard_exec }}", "rollback", "--root", "{{ slmguard_root }}"]
            },
            "register": "slmguard_rollback",
            "changed_when": "'nothing to roll back' not in slmguard_rollback.stdout",
            "when": "slmguard_manifest.stat.exists",
        },
        {
            "name": "Remove the staging directory",
            "ansible.builtin.file": {"path": "{{ slmguard_stage_dir }}", "state": "absent"},
        },
    ]


def meta() -> dict[str, object]:
    return {
        "galaxy_info": {
            "role_name": ROLE,
            "author": "slmguard",
            "description": "Deploy a slmguard plan on a board (slmguard apply on the board)",
            "license": "Apache-2.0",
            "min_ansible_version": "2.16",
            "platforms": [{"name": "Debian", "versions": ["all"]}],
        },
        "dependencies": [],
    }


def playbook(name: str, role_tasks: str | None = None) -> list[object]:
    role: dict[str, object] = {"name": ROLE}
    if role_tasks:
        role["tasks_from"] = role_tasks
    return [
        {
            "name": name,
            "hosts": "slmguard",
            "gather_facts": False,
            "become": True,
            "tasks": [
                {
                    "name": "Run the slmguard role" + (f" ({role_tasks})" if role_tasks else ""),
                    "ansible.builtin.include_role": role,
                }
            ],
        }
    ]


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


def ansible_cfg() -> bytes:
    return (
        b"# Rendered by slmguard: run ansible-playbook from this directory.\n"
        b"[defaults]\n"
        b"inventory = inventory/hosts.yml\n"
        b"roles_path = roles\n"
        b"interpreter_python = auto_silent\n"
        b"retry_files_enabled = False\n"
        b"\n"
        b"[ssh_connection]\n"
        b"pipelining = True\n"
    )


def lint_config() -> bytes:
    """``.ansible-lint``: offline (no collection or schema download), the production profile."""
    return _doc({"profile": "production", "offline": True, "exclude_paths": ["plans/"]})


def render_tree(bps: tuple[BoardPlan, ...]) -> tuple[RenderedFile, ...]:
    """Every file of ``render --target ansible``, at paths relative to the output directory."""

    def f(path: str, content: bytes, why: str) -> RenderedFile:
        return RenderedFile(path, content=content, why=why)

    files = [
        f("/ansible.cfg", ansible_cfg(), "ansible-playbook settings"),
        f("/.ansible-lint", lint_config(), "ansible-lint, offline"),
        f("/site.yml", _doc(playbook("Deploy slmguard to the boards")), "deploy playbook"),
        f(
            "/rollback.yml",
            _doc(playbook("Roll slmguard back on the boards", "rollback")),
            "rollback playbook",
        ),
        f("/inventory/hosts.yml", _doc(inventory(bps)), "one group per board kind"),
        f(f"{ROLE_DIR}/defaults/main.yml", _doc(defaults()), "role defaults"),
        f(f"{ROLE_DIR}/meta/main.yml", _doc(meta()), "role metadata"),
        f(f"{ROLE_DIR}/tasks/main.yml", _doc(tasks()), "deploy tasks"),
        f(f"{ROLE_DIR}/tasks/rollback.yml", _doc(rollback_tasks()), "rollback tasks"),
        f(f"{ROLE_DIR}/handlers/main.yml", _doc(handlers()), "restart what changed"),
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

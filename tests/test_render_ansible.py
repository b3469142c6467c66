"""``render --target ansible``: the role is linted, and run for real.

- every board preset renders into one inventory (a group per board kind) that
  ``ansible-lint`` passes (production profile, offline: ansible.builtin only);
  the role's argument specs cover every default, and its defaults name the
  paths :mod:`slmguard.deploy.units` declares;
- the role runs with ``ansible-playbook`` against this machine (local
  connection) into a temporary board root (``slmguard_root``): the first run
  deploys what ``slmguard apply`` deploys (the same bytes as the files
  renderer), a second run and ``--check`` change nothing, a changed plan
  changes the plan file and the restart tasks see it, ``rollback.yml`` goes
  back to the first plan byte for byte, ``uninstall.yml`` restores the root
  byte for byte and a second one changes nothing;
- a plan whose names hold Jinja (``{{ lookup('pipe', ...) }}``) runs nothing
  on the controller, and the same tree without the ``!unsafe`` tags would
  (so the test can fail).

Starting the services and the gate against a real server: the simulated fleet
(``tests/test_fleet_rollout.py``) and the system test's VM (``make systest``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleetsim import CALLBACKS, ansible_env
from fleettrees import BOARDS, fleet
from rendertrees import make_board_root, make_model_file, make_plan, run_cli, snapshot, write
from slmguard.cli import main
from slmguard.deploy.fleet.ansible import AnsibleOptions, fixed_files, render_tree
from slmguard.deploy.fleet.kinds import board_plans, board_slug
from slmguard.deploy.modelfile import board_models, planned_model
from slmguard.deploy.render import RenderOptions, render_deployment
from slmguard.deploy.review import write_tree
from slmguard.deploy.target import TargetState
from slmguard.errors import SlmguardError
from slmguard.plan.planfile import dumps_plan, load_plan
from slmguard.plan.schema import Plan

BIN = Path(sys.executable).parent
SLMGUARD = str(BIN / "slmguard")
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the role installs root-owned files (copy owner=root)"
)


def _load(text: str) -> Any:
    """A YAML file of the tree, as Ansible reads it (``!unsafe`` included)."""
    from ansible.parsing.yaml.loader import AnsibleLoader

    return AnsibleLoader(text).get_single_data()


def _lint(tree: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ansible-lint"), "--nocolor"],
        cwd=tree,
        env=ansible_env(tmp),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def full_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fleet") / "tree"
    write_tree(render_tree(fleet()), out)
    return out


def test_every_board_kind_gets_a_group_and_parses(full_tree: Path) -> None:
    inv = _load((full_tree / "inventory/hosts.yml").read_text())
    groups = inv["all"]["children"]["slmguard"]["children"]
    assert len(groups) == len(BOARDS)
    for bp in fleet():
        gv = _load((full_tree / f"inventory/group_vars/{bp.group}.yml").read_text())
        assert gv["slmguard_board"] == bp.plan.board.name
        assert gv["slmguard_plan"] == f"{{{{ playbook_dir }}}}/plans/{bp.slug}.json"
        assert load_plan(full_tree / f"plans/{bp.slug}.json") == bp.plan
        assert gv["slmguard_ready_timeout_s"] >= 2 * 30
    for path in full_tree.rglob("*.yml"):
        assert _load(path.read_text()) is not None, path


def test_the_defaults_are_specified_and_name_apply_s_paths(full_tree: Path) -> None:
    from slmguard.deploy import manifest, units

    role = full_tree / "roles/slmguard"
    defaults = _load((role / "defaults/main.yml").read_text())
    specs = _load((role / "meta/argument_specs.yml").read_text())["argument_specs"]
    assert set(specs) == {"main", "rollback", "uninstall"}
    for entry in specs.values():
        assert set(entry["options"]) == set(defaults), "every default has its spec, no more"
    readme = (role / "README.md").read_text()
    assert [n for n in defaults if f"`{n}`" not in readme] == []
    assert defaults["slmguard_unit_dir"] == units.UNIT_DIR
    assert defaults["slmguard_installed_plan"] == units.PLAN_PATH
    assert defaults["slmguard_api_key_file"] == units.API_KEY_PATH
    assert defaults["slmguard_apply_manifest"] == manifest.MANIFEST_DEST
    assert defaults["slmguard_protect_dropin"] == units.PROTECT_DROPIN
    assert defaults["slmguard_port"] == units.PORT
    assert defaults["slmguard_services"] == [units.SERVICE, units.WATCH_SERVICE]
    assert defaults["slmguard_units"] == [
        units.SERVICE,
        units.WATCH_SERVICE,
        units.CRASHDUMP_SERVICE,
    ]
    unit_files = {f"{units.UNIT_DIR}/{n}" for n in (units.SERVICE, units.INFERENCE_SLICE)}
    secrets = {units.PLAN_PATH, units.ADMIN_TOKEN_PATH, units.API_KEY_PATH}
    assert set(defaults["slmguard_server_files"]) == unit_files | secrets
    assert set(defaults["slmguard_watch_files"]) == {
        f"{units.UNIT_DIR}/{units.WATCH_SERVICE}",
        units.PLAN_PATH,
        units.ADMIN_TOKEN_PATH,
    }
    restart = (role / "tasks/restart.yml").read_text()
    assert f"name: {units.SERVICE}" in restart and f"name: {units.WATCH_SERVICE}" in restart


def _deb(tmp: Path, version: str, arch: str = "amd64", name: str = "slmguard") -> Path:
    path = tmp / f"{name}_{version}_{arch}.deb"
    path.write_bytes(b"!<arch>\n" + (name + arch).encode() * 100)
    return path


def test_packages_and_the_mirror_are_pinned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import hashlib

    from slmguard import __version__

    model, size, digest = make_model_file(tmp_path / "m v1.gguf")
    plan = tmp_path / "plan.json"
    plan.write_text(
        dumps_plan(make_plan(model_path=str(model), model_bytes=size, model_sha256=digest))
    )
    amd, arm = _deb(tmp_path, f"{__version__}-1"), _deb(tmp_path, f"{__version__}-1", "arm64")
    split = [
        _deb(tmp_path, "1+aaaa-1", "arm64", "slmguard-deps"),
        _deb(tmp_path, "0.3.36+bbbb-1", "arm64", "slmguard-engine-dotprod"),
        _deb(tmp_path, "0.3.36+cccc-1", "arm64", "slmguard-engine-armv8"),
        _deb(tmp_path, "0.3.36+dddd-1", "amd64", "slmguard-engine-avx2"),
        _deb(tmp_path, f"1+{digest[:16]}-1", "all", "slmguard-model-m-v1"),
    ]
    out = tmp_path / "out"
    base = ["render", "--target", "ansible", "--plan", str(plan), "--out", str(out)]
    given = [arg for p in (amd, arm, *split) for arg in ("--package", str(p))]
    code, text = run_cli([*base, *given, "--model-mirror", "https://m.example/x/"], capsys)
    assert code == 0, text
    fleet_vars = _load((out / "inventory/group_vars/slmguard.yml").read_text())
    assert fleet_vars["slmguard_version"] == __version__
    assert fleet_vars["slmguard_package_version"] == f"{__version__}-1"
    pins = fleet_vars["slmguard_packages"]
    sha = hashlib.sha256(arm.read_bytes()).hexdigest()
    assert pins["slmguard"]["arm64"] == {"file": str(arm), "sha256": sha, "version": "0.1.0-1"}
    assert pins["slmguard"]["amd64"]["file"] == str(amd)
    assert pins["slmguard-deps"]["arm64"]["version"] == "1+aaaa-1"
    assert pins["slmguard-model-m-v1"]["all"]["file"] == str(split[-1])
    (gv_path,) = (out / "inventory/group_vars").glob("slmguard_*_*.yml")
    gv = _load(gv_path.read_text())
    assert gv["slmguard_model_url"] == "https://m.example/x/m_v1.gguf"
    assert gv["slmguard_model_sha256"] == digest and gv["slmguard_model_size"] == size
    # An RK3588 kind gets the dotprod engine alone; the model package carries its model.
    assert gv["slmguard_engine_packages"] == ["slmguard-engine-dotprod"]
    assert gv["slmguard_model_package"] == "slmguard-model-m-v1"
    assert gv["slmguard_model_file"] == f"/usr/share/slmguard/models/by-sha256/{digest}"
    force = [*base, "--force"]
    for extra, needle in (
        (["--package", str(_deb(tmp_path, "0.0.1-1"))], "the board must run the version"),
        (["--package", str(tmp_path / "plan.json")], "not a slmguard package file"),
        (["--package", str(amd), "--package", str(amd)], "two files of slmguard for amd64"),
        (["--package", str(_deb(tmp_path, "1+a-1", "all", "slmguard-deps"))], "not built for all"),
        (["--model-mirror", "ftp://m.example/x"], "need an http:// or https://"),
        (["--model-mirror", "https://u:p@m.example/x"], "no credentials"),
        (["--model-mirror", "https://m.example/x y"], "need an http"),
        (["--model-mirror", "https://m.example/x?a=1"], "need an http"),
    ):
        code, text = run_cli([*force, *extra], capsys)
        assert code == 64 and needle in text, (extra, text)
    code, text = run_cli(
        ["render", "--plan", str(plan), "--out", str(tmp_path / "f"), "--model-mirror", "http://x"],
        capsys,
    )
    assert code == 64 and "--model-mirror does not apply to --target files" in text


def test_ansible_lint_passes_offline(full_tree: Path, tmp_path: Path) -> None:
    done = _lint(full_tree, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Profile 'production' was required, and it passed" in done.stdout + done.stderr
    assert "collection" not in (done.stdout + done.stderr).lower()


def test_ansible_lint_catches_a_broken_task(full_tree: Path, tmp_path: Path) -> None:
    tree = tmp_path / "broken"
    shutil.copytree(full_tree, tree, symlinks=True)
    tasks = tree / "roles/slmguard/tasks/stage.yml"
    tasks.write_text(tasks.read_text().replace("ansible.builtin.command:", "command:", 1))
    done = _lint(tree, tmp_path)
    assert done.returncode != 0
    assert "fqcn" in done.stdout + done.stderr


def test_the_playbooks_pass_ansible_syntax_check(full_tree: Path, tmp_path: Path) -> None:
    for book in ("site.yml", "rollback.yml", "uninstall.yml"):
        done = subprocess.run(
            [str(BIN / "ansible-playbook"), "--syntax-check", book],
            cwd=full_tree,
            env=ansible_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr


# --------------------------------------------------------------------------- real runs


class Board:
    """A temporary board root, a file plan for it, the rendered tree and a local inventory."""

    def __init__(self, tmp: Path, plan: Plan | None = None) -> None:
        self.tmp = tmp
        self.root = make_board_root(tmp / "root", "armbian")
        (self.root / "var/lib").mkdir(parents=True)  # a board has it (the role stages there)
        model, size, digest = make_model_file(tmp / "controller/m.gguf")
        self.plan = plan or make_plan(model_path=str(model), model_bytes=size, model_sha256=digest)
        self.plan_file = tmp / "controller/plan.json"
        self.plan_file.write_text(dumps_plan(self.plan))
        self.tree = tmp / "tree"
        self.render()
        self.inventory = tmp / "local.yml"
        self.host = {
            "ansible_connection": "local",
            "ansible_become": False,
            "ansible_python_interpreter": sys.executable,
            "slmguard_root": str(self.root),
            "slmguard_exec": SLMGUARD,
            "slmguard_service_manager": "none",  # no systemd here: the VM starts them
            "slmguard_install_package": False,  # slmguard is this venv's (no .deb here)
            "slmguard_doctor_max_exit": 2,  # an image root: cma= only after a reboot
        }
        self.write_inventory()

    def write_inventory(self) -> None:
        self.inventory.write_text(
            json.dumps(
                {
                    "all": {
                        "children": {
                            "slmguard": {
                                "children": {self.group(): {"hosts": {"board-1": self.host}}}
                            }
                        }
                    }
                }
            )
        )

    def render(self, *extra: str) -> None:
        with pytest.raises(SystemExit) as exc:
            main(
                [
                    "render",
                    "--target",
                    "ansible",
                    "--plan",
                    str(self.plan_file),
                    "--out",
                    str(self.tree),
                    *extra,
                ]
            )
        assert exc.value.code in (0, None)

    def group(self) -> str:
        inv = _load((self.tree / "inventory/hosts.yml").read_text())
        (name,) = inv["all"]["children"]["slmguard"]["children"]
        return str(name)

    def play(self, book: str, *args: str, ok: bool = True) -> dict[str, Any]:
        done = subprocess.run(
            [
                str(BIN / "ansible-playbook"),
                "-i",
                "inventory/hosts.yml",
                "-i",
                str(self.inventory),
                book,
                *args,
            ],
            cwd=self.tree,
            env=ansible_env(
                self.tmp,
                ANSIBLE_STDOUT_CALLBACK="recorder",
                ANSIBLE_CALLBACK_PLUGINS=CALLBACKS,
                SLMGUARD_FLEET_REPORT_DIR=str(self.tmp / "reports"),
            ),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert (done.returncode == 0) == ok, done.stdout[-6000:] + done.stderr[-3000:]
        # The recorder's JSON; the fleet report's callback names its file after it.
        (line,) = [x for x in done.stdout.splitlines() if x.startswith('{"plays"')]
        result: dict[str, Any] = json.loads(line)
        return result


def _deployed(root: Path) -> dict[str, tuple[object, ...]]:
    """What apply deployed under ``root`` (without its own records and the role's staging)."""
    own = ("var/lib/slmguard-apply", "var/lib/slmguard-fleet")
    return {k: v for k, v in snapshot(root).items() if not k.startswith(own)}


def _changed(result: dict[str, Any]) -> int:
    return int(result["stats"]["board-1"]["changed"])


def _task(result: dict[str, Any], name: str) -> dict[str, Any]:
    for play in result["plays"]:
        for task in play["tasks"]:
            if task["task"]["name"].split(" : ", 1)[-1] == name:  # "slmguard : Apply..."
                return dict(task["hosts"]["board-1"])
    raise AssertionError(f"no task {name!r}")


@needs_root
@pytest.mark.slow
def test_deploy_is_apply_idempotent_and_rolls_back_byte_for_byte(tmp_path: Path) -> None:
    board = Board(tmp_path)
    before = snapshot(board.root)
    board.host["slmguard_protect"] = ["nginx.service"]
    board.write_inventory()
    dropin = "/etc/systemd/system/nginx.service.d/50-slmguard-protect.conf"

    first = board.play("site.yml")
    assert _changed(first) > 0
    applied = _task(first, "Apply the plan")
    assert json.loads(applied["stdout"])["changed"] is True
    assert applied["took_s"] >= 0  # the recorder times each result (systest reports them)
    # Exactly the bytes the files renderer gives for this root and model: one source.
    (staged,) = board.root.glob("var/lib/slmguard-fleet/models/*/m.gguf")
    model = planned_model(board.plan, staged)
    opts = RenderOptions(exec_path=SLMGUARD, protect=("nginx.service",))
    deployment = render_deployment(board.plan, opts, TargetState(), model)
    for f in deployment.files:
        dest = board.root / f.path.lstrip("/")
        if f.content is not None:
            assert dest.read_bytes() == f.content, f.path
        elif f.link is not None:
            assert os.readlink(dest) == f.link, f.path
        elif f.model is not None:
            assert dest.read_bytes() == (tmp_path / "controller/m.gguf").read_bytes()
        else:
            assert dest.stat().st_mode & 0o777 == 0o600  # the admin token, made on the board
    # The plan's cma= takes effect at the next boot: reported (slmguard_reboot is false).
    assert "next boot" in _task(first, "Say the board needs a reboot for its new cma=")["msg"]
    token = (board.root / "etc/slmguard/admin-token").read_text().strip()
    assert len(token) >= 40
    assert token not in json.dumps(first)  # never in Ansible's output
    assert token not in "".join(p.read_text() for p in board.tree.rglob("*") if p.is_file())

    first_deployment = _deployed(board.root)

    second = board.play("site.yml")
    assert _changed(second) == 0, [t["task"]["name"] for p in second["plays"] for t in p["tasks"]]
    assert json.loads(_task(second, "Apply the plan")["stdout"])["changed"] is False
    assert _task(second, "Note what apply changed")["ansible_facts"]["slmguard_changed"] == []
    checked = board.play("site.yml", "--check")
    assert _changed(checked) == 0

    # A new plan for the same board: apply replaces the plan, the handlers are told.
    from dataclasses import replace

    board.plan = replace(board.plan, engine=replace(board.plan.engine, n_ctx=1024))
    board.plan_file.write_text(dumps_plan(board.plan))
    board.render()
    # ... and no protected service any more: the role says so (--no-protect), since apply
    # alone keeps the services the deployment in place protects.
    board.host["slmguard_protect"] = []
    board.write_inventory()
    dry = board.play("site.yml", "--check")
    assert _changed(dry) >= 1
    assert "/etc/slmguard/plan.json" in _task(dry, "Show what apply would change")["stdout"]
    third = board.play("site.yml")
    changed = _task(third, "Note what apply changed")["ansible_facts"]["slmguard_changed"]
    assert "/etc/slmguard/plan.json" in changed
    assert "/etc/systemd/system/slmguard.service" not in changed  # same unit text
    assert dropin in changed and not (board.root / dropin.lstrip("/")).exists()

    # rollback.yml undoes this tree's rollout: the first plan again, byte for byte.
    back = board.play("rollback.yml")
    went = _task(back, "Go back to the plan before the rollout, if the rollout moved the board")
    assert "/etc/slmguard/plan.json" in json.loads(went["stdout"])["restored"]
    assert _deployed(board.root) == first_deployment
    again = board.play("rollback.yml")  # undone already: nothing moves
    assert _changed(again) == 0

    gone = board.play("uninstall.yml")
    assert _changed(gone) > 0
    assert snapshot(board.root) == before
    again = board.play("uninstall.yml")
    assert _changed(again) == 0


@needs_root
@pytest.mark.slow
def test_the_install_chooses_each_package_the_board_lacks(tmp_path: Path) -> None:
    """--check --tags install against this host's dpkg (no slmguard package installed): every
    pinned package is chosen, copied in check mode only, nothing installed."""
    from slmguard import __version__

    debs = [
        _deb(tmp_path, f"{__version__}-1"),
        _deb(tmp_path, "1+aaaa-1", "amd64", "slmguard-deps"),
        _deb(tmp_path, "0.3.36+bbbb-1", "amd64", "slmguard-engine-avx2"),
    ]
    board = Board(tmp_path)
    board.render(*(arg for p in debs for arg in ("--package", str(p))), "--force")
    board.host.update(slmguard_install_package=True)
    board.write_inventory()
    result = board.play("site.yml", "--check", "--tags", "install")
    noted = [
        r["item"]
        for p in result["plays"]
        for t in p["tasks"]
        if t["task"]["name"].endswith("Note each package whose pinned version is not installed")
        for r in t["hosts"]["board-1"].get("results", [])
        if not r.get("skipped")
    ]
    assert noted == ["slmguard-deps", "slmguard-engine-avx2", "slmguard"]
    copied = _task(result, "Copy the packages from the controller")
    assert [r["item"] for r in copied["results"] if r.get("changed")] == noted
    assert _task(result, "Install the packages").get("skipped")  # check mode: nothing runs
    assert not (board.root / "var/lib/slmguard-fleet/debs").exists()


@needs_root
@pytest.mark.slow
def test_a_board_that_is_not_its_groups_kind_fails_untouched(tmp_path: Path) -> None:
    board = Board(tmp_path)  # the plan is for an rk3588-4g
    write(board.root, "proc/device-tree/model", "Raspberry Pi 5 Model B Rev 1.0\0")
    write(board.root, "proc/device-tree/compatible", "raspberrypi,5-model-b\0brcm,bcm2712\0")
    write(board.root, "sys/devices/system/cpu/online", "0-3\n")
    before = snapshot(board.root)
    result = board.play("site.yml", ok=False)
    failed = _task(result, "Stage the plan and the model")
    error = json.loads(failed["stdout"])["error"]
    assert failed.get("failed") and "is not a rk3588-4g" in error, failed
    assert "this host is a rpi5 board" in error
    assert "Apply the plan" not in json.dumps(result)  # stopped before apply
    assert "Copy the model from the controller" not in json.dumps(result)  # nothing copied
    assert snapshot(board.root) == before  # nothing staged, downloaded or written


@needs_root
@pytest.mark.slow
def test_jinja_in_plan_names_is_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "INJECTED"
    evil = "{{ lookup('pipe', 'touch " + str(marker) + "') }}"
    from boardfiles import files_plan

    # a board plan with a projector: the mirror's Jinja reaches every file's URL too
    board = Board(tmp_path, files_plan(tmp_path / "controller")[1])
    # the same file plan, now with Jinja in its board and model names, and in the mirror
    board.plan = replace_names(board.plan, evil)
    board.plan_file.write_text(dumps_plan(board.plan))
    shutil.rmtree(board.tree)
    # (no spaces in a URL: ${IFS} is the shell's, which the pipe lookup runs)
    board.render(
        "--model-mirror", "http://127.0.0.1:9/{{lookup('pipe','touch${IFS}" + str(marker) + "')}}"
    )
    board.write_inventory()
    assert board.group() == "slmguard_" + board_slug(evil).replace("-", "_")
    result = board.play("site.yml", "--check")
    # The plan went to the board as it is (slmguard stage reads it on stdin), never templated.
    staged = _task(result, "Stage the plan and the model")
    assert evil in staged["invocation"]["module_args"]["stdin"]
    assert staged["rc"] == 0
    argv = staged["invocation"]["module_args"]["argv"]
    urls = [argv[i + 1] for i, a in enumerate(argv) if a == "--file-url"]
    assert len(urls) == 2 and all("{{lookup('pipe'" in u for u in urls), argv
    assert not marker.exists()
    # Without the !unsafe tags, Ansible runs the lookup on the controller.
    for gv in (board.tree / "inventory/group_vars").glob("*.yml"):
        gv.write_text(gv.read_text().replace("!unsafe ", ""))
    board.play("site.yml", "--check")
    assert marker.exists()


def _files_of(plan: Plan) -> list[Any]:
    """The plan's files: the model, the board's other models, the projector."""
    return [plan.model, *(m.model for m in plan.models), plan.projector]


def test_a_board_s_files_are_rendered_as_unsafe_data(tmp_path: Path) -> None:
    """Each of the plan's other files is in the kind's vars with its size and sha256, every
    string !unsafe, the name reduced to a plain file name (issues 39, 42)."""
    from boardfiles import files_plan

    _, plan = files_plan(tmp_path, "re{{ lookup('pipe','id') }}rank.gguf")
    bp = board_plans([(plan, planned_model(plan, None), board_models(plan))])
    files = {f.path: f.content for f in render_tree(bp, AnsibleOptions(model_mirror="https://m.x"))}
    (gv,) = [c for p, c in files.items() if p.startswith("/inventory/group_vars/slmguard_")]
    assert gv is not None
    text = gv.decode()
    got = _load(text)["slmguard_files"]
    assert [(f["kind"], f["size"], f["sha256"]) for f in got] == [
        ("model", s.file_bytes, s.sha256) for s in _files_of(plan)[1:2]
    ] + [("projector", plan.projector.file_bytes, plan.projector.sha256)]  # type: ignore[union-attr]
    assert got[0]["name"] == "re___lookup__pipe___id_____rank.gguf"
    assert got[0]["url"] == "https://m.x/re___lookup__pipe___id_____rank.gguf"
    assert got[0]["src"] == plan.models[0].model.path
    assert "src: !unsafe " in text and "name: !unsafe " in text and "url: !unsafe " in text


@needs_root
@pytest.mark.slow
def test_a_board_s_models_and_projector_are_deployed_and_rolled_back(tmp_path: Path) -> None:
    """A board of two models with a vision projector (issues 39, 42): every file is staged
    (copied from the controller, hashed once), installed and named in the installed plan,
    the unit passes the projector; a second run and --check change nothing; rollback.yml
    takes every file away again and uninstall.yml leaves the root as it was."""
    from boardfiles import files_plan

    _, plan = files_plan(tmp_path / "controller")
    board = Board(tmp_path, plan)
    before = snapshot(board.root)
    first = board.play("site.yml")
    copied = _task(first, "Copy the plan's other files from the controller (there is no mirror)")
    assert [r["changed"] for r in copied["results"]] == [True, True]
    again = json.loads(_task(first, "Check the copied files (each hashed once)")["stdout"])
    assert [f["how"] for f in again["files"]] == ["verified", "verified"]
    installed = load_plan(board.root / "etc/slmguard/plan.json")
    for planned, placed in zip(_files_of(plan), _files_of(installed), strict=True):
        assert placed.path.startswith("/var/lib/slmguard-models/"), placed.path
        assert (placed.file_bytes, placed.sha256) == (planned.file_bytes, planned.sha256)
        assert (board.root / placed.path.lstrip("/")).read_bytes() == Path(
            planned.path
        ).read_bytes()
    unit = (board.root / "etc/systemd/system/slmguard.service").read_text()
    assert "--mmproj /var/lib/slmguard-models/mmproj-tiny.gguf" in unit

    # The controller's files gone (here the board is this machine): apply must be taking
    # the staged copies (--board-model, --mmproj), not the paths the plan names.
    for spec in _files_of(plan)[1:]:
        Path(spec.path).rename(spec.path + ".away")
    second = board.play("site.yml")
    assert _changed(second) == 0, [t["task"]["name"] for p in second["plays"] for t in p["tasks"]]
    staged = json.loads(_task(second, "Stage the plan and the model")["stdout"])
    assert [f["how"] for f in staged["files"]] == ["kept", "kept"]
    assert _changed(board.play("site.yml", "--check")) == 0

    back = board.play("rollback.yml")
    assert _changed(back) > 0
    models = board.root / "var/lib/slmguard-models"
    assert not models.exists() or not any(models.iterdir())
    assert _deployed(board.root) == _deployed_of(before)
    board.play("uninstall.yml")
    assert snapshot(board.root) == before


def _deployed_of(snap: dict[str, tuple[object, ...]]) -> dict[str, tuple[object, ...]]:
    own = ("var/lib/slmguard-apply", "var/lib/slmguard-fleet")
    return {k: v for k, v in snap.items() if not k.startswith(own)}


def with_neighbours(plan: Plan) -> Plan:
    """``plan`` with the board's other services (issue 39): one with a unit, one without."""
    from dataclasses import replace

    from slmguard.plan.schema import Neighbour

    return replace(
        plan,
        neighbours=(
            Neighbour("whisper", 300 * 1024 * 1024, unit="whisper.service"),
            Neighbour("camera", 100 * 1024 * 1024, protection="low"),
        ),
    )


def test_the_neighbours_units_are_rendered_and_refused_when_hostile(tmp_path: Path) -> None:
    model, size, digest = make_model_file(tmp_path / "m.gguf")
    plan = with_neighbours(make_plan(model_path=str(model), model_bytes=size, model_sha256=digest))
    files = {
        f.path: f.content for f in render_tree(board_plans([(plan, planned_model(plan, None))]))
    }
    (gv,) = [c for p, c in files.items() if p.startswith("/inventory/group_vars/slmguard_")]
    assert gv is not None
    assert _load(gv.decode())["slmguard_neighbour_units"] == ["whisper.service"]
    from dataclasses import replace

    evil = replace(plan.neighbours[0], unit="x.service\nExecStart=/bin/sh")
    with pytest.raises(SlmguardError, match="unit"):
        hostile = replace(plan, neighbours=(evil,))
        render_tree(board_plans([(hostile, planned_model(plan, None))]))


@needs_root
@pytest.mark.slow
def test_a_neighbour_is_protected_and_restarted_with_the_protected(tmp_path: Path) -> None:
    """apply on the board writes the neighbour's drop-in; the restart task's loop holds it
    with the --protect services (skipped here: no systemd in a board root)."""
    model, size, digest = make_model_file(tmp_path / "controller/m.gguf")
    board = Board(
        tmp_path,
        with_neighbours(make_plan(model_path=str(model), model_bytes=size, model_sha256=digest)),
    )
    board.host["slmguard_protect"] = ["mosquitto.service"]
    board.write_inventory()
    result = board.play("site.yml")
    dropin = board.root / "etc/systemd/system/whisper.service.d/50-slmguard-protect.conf"
    assert "MemoryMin=300M" in dropin.read_text()
    changed = _task(result, "Note what apply changed")["ansible_facts"]["slmguard_changed"]
    assert "/etc/systemd/system/whisper.service.d/50-slmguard-protect.conf" in changed
    restart = _task(result, "Restart the protected services")
    assert [r["item"] for r in restart["results"]] == ["mosquitto.service", "whisper.service"]


def replace_names(plan: Plan, name: str) -> Plan:
    from dataclasses import replace

    return replace(plan, board=replace(plan.board, name=name), model=replace(plan.model, name=name))


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, size, digest = make_model_file(tmp_path / "m.gguf")
    plan = tmp_path / "plan.json"
    plan.write_text(
        dumps_plan(make_plan(model_path=str(model), model_bytes=size, model_sha256=digest))
    )
    preset = tmp_path / "preset.json"
    preset.write_text(dumps_plan(make_plan(model_path=None)))
    base = ["render", "--target", "ansible", "--out", str(tmp_path / "out")]
    code, text = run_cli([*base, "--plan", str(plan)], capsys)
    assert code == 0 and f"rendered {len(fixed_files()) + 4} files" in text
    code, text = run_cli([*base, "--plan", str(plan), "--protect", "x.service"], capsys)
    assert code == 64 and "--protect does not apply to --target ansible" in text
    code, text = run_cli([*base, "--plan", str(plan), "--image", "a:1"], capsys)
    assert code == 64 and "--image does not apply to --target ansible" in text
    code, text = run_cli([*base, "--plan", str(preset), "--force"], capsys)
    assert code == 78 and "names no model file" in text
    code, text = run_cli([*base, "--plan", str(plan), "--plan", str(plan), "--force"], capsys)
    assert code == 78 and "one plan per board kind" in text
    code, text = run_cli(["render", "--plan", str(plan), "--plan", str(plan), "--out", "x"], capsys)
    assert code == 64 and "--target files takes one --plan" in text

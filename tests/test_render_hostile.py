"""Untrusted text never becomes syntax: hostile plans rendered, checked by systemd itself.

The plans here are built as :class:`Plan` objects directly, bypassing the plan
loader: the escaping layer (``slmguard.deploy.escape``) must be safe on its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from rendertrees import ARMBIAN_ENV, FSTAB_WITH_SWAP, make_board_root, make_plan
from slmguard.deploy import escape
from slmguard.deploy.render import Deployment, RenderOptions, render_deployment
from slmguard.deploy.system import sysctl_keys
from slmguard.deploy.target import read_target
from slmguard.errors import RefusedError
from slmguard.plan.schema import Plan
from systemdunits import find_systemd_analyze, materialize, sections, verify

INJECTION = "tiny\n[Service]\nExecStartPre=+/bin/touch /x\n"
HOSTILE_NAMES = {
    "injection": INJECTION,
    "specifiers": "%n %h %d %% 100%",
    "backslashes": "a\\b\\\\c\\",
    "quotes": 'it\'s "quoted" `and` $HOME ${HOME}',
    "control": "nul\x00cr\rtab\tesc\x1b[31m del\x7f ls\u2028ps\u2029 rlo\u202e",
    "long": "Q" * 5000 + "\nExecStartPre=+/bin/sh",
    "brackets": "[Install]\nWantedBy=sysinit.target",
}


@pytest.fixture(scope="session")
def analyze() -> str:
    return find_systemd_analyze()


def _exec_path() -> str:
    own = Path(sys.executable).parent / "slmguard"
    return str(own) if own.exists() else sys.executable


def _named(plan: Plan, name: str) -> Plan:
    return replace(plan, model=replace(plan.model, name=name), board=replace(plan.board, name=name))


def _deploy(plan: Plan, root: Path) -> Deployment:
    opts = RenderOptions(exec_path=_exec_path(), protect=("nginx.service",))
    return render_deployment(plan, opts, read_target(root, plan))


def _by_path(d: Deployment) -> dict[str, bytes]:
    return {f.path: f.content for f in d.files if f.content is not None}


def _keys(text: str) -> list[tuple[str, str]]:
    return [(sec, key) for sec, pairs in sections(text).items() for key, _ in pairs]


@pytest.mark.parametrize("name", sorted(HOSTILE_NAMES))
def test_hostile_names_render_to_the_same_syntax_as_a_plain_one(
    analyze: str, tmp_path: Path, name: str
) -> None:
    hostile = _named(make_plan(), HOSTILE_NAMES[name])
    got = _by_path(_deploy(hostile, make_board_root(tmp_path / "a", "armbian")))
    plain = _by_path(_deploy(make_plan(), make_board_root(tmp_path / "b", "armbian")))
    assert set(got) == set(plain)
    units = [p for p in got if p.startswith("/etc/systemd/system/")]
    assert len(units) == 7
    for path in units:
        text = got[path].decode()
        assert not [ln for ln in text.splitlines() if ln.startswith("ExecStartPre")], path
        assert _keys(text) == _keys(plain[path].decode()), path  # no extra key or section
        for line in text.splitlines():
            assert line.isprintable() and len(line) < 400, (path, line)
            assert not line.endswith("\\"), (path, line)
    # systemd itself parses them without a complaint.
    unit_dir = tmp_path / "units"
    written = materialize(_deploy(hostile, tmp_path / "a").files, unit_dir)
    (unit_dir / "nginx.service").write_text("[Service]\nExecStart=/bin/true\n")
    assert verify(analyze, [*written, unit_dir / "nginx.service"]) == ""
    # The sysctl file sets exactly its three keys; the comment is one line.
    sysctl_path, boot_path = "/etc/sysctl.d/99-slmguard.conf", "/boot/armbianEnv.txt"
    sysctl = got[sysctl_path].decode()
    assert sysctl_keys(sysctl) == ["vm.swappiness", "vm.overcommit_memory", "vm.overcommit_ratio"]
    assert [ln for ln in sysctl.splitlines() if not ln.startswith("#")] == [
        ln for ln in plain[sysctl_path].decode().splitlines() if not ln.startswith("#")
    ]
    # The boot file gets only the cma= change, the fstab only its swap line commented.
    boot = got[boot_path].decode()
    assert boot == ARMBIAN_ENV.replace("extraargs=cma=256M", "extraargs=cma=512M")
    assert got["/etc/fstab"] == plain["/etc/fstab"] != FSTAB_WITH_SWAP.encode()
    # The plan file is JSON: the name survives as data.
    assert json.loads(got["/etc/slmguard/plan.json"])["model"]["name"] == HOSTILE_NAMES[name]


@pytest.mark.parametrize(
    ("plan", "field"),
    [
        (make_plan(cma_bytes=-(1 << 20)), "plan.kernel.cma_bytes"),
        (replace(make_plan(), cpu_affinity=(-2, -1)), "plan.cpu_affinity[0]"),
        (replace(make_plan(), cpu_affinity=(1 << 40,)), "plan.cpu_affinity[0]"),
        (make_plan(device_nodes=("/dev/%h",)), "plan.board.device_nodes[0]"),
        (make_plan(device_nodes=("/dev/../etc/shadow",)), "plan.board.device_nodes[0]"),
        (make_plan(device_nodes=("/dev/x\nExecStartPre=/bin/sh",)), "plan.board.device_nodes"),
        (make_plan(device_groups=("video\nUser=root",)), "plan.board.device_groups[0]"),
    ],
)
def test_hostile_values_are_refused_before_anything_is_written(
    tmp_path: Path, plan: Plan, field: str
) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    with pytest.raises(RefusedError) as err:
        _deploy(plan, root)
    assert err.value.exit_code == 78
    assert field in err.value.message and "\n" not in err.value.message


@pytest.mark.parametrize(
    ("kernel", "field"),
    [
        ({"swappiness": -5}, "plan.kernel.swappiness"),
        ({"swappiness": 10**5000}, "plan.kernel.swappiness"),
        ({"overcommit_memory": 7}, "plan.kernel.overcommit_memory"),
        ({"overcommit_memory": 2, "overcommit_ratio": 1 << 40}, "plan.kernel.overcommit_ratio"),
    ],
)
def test_sysctl_values_outside_the_kernels_range_are_refused(
    tmp_path: Path, kernel: dict[str, int], field: str
) -> None:
    plan = make_plan(overcommit_memory=0)
    plan = replace(plan, kernel=replace(plan.kernel, **kernel))  # type: ignore[arg-type]
    with pytest.raises(RefusedError, match=field):
        _deploy(plan, make_board_root(tmp_path / "root", "armbian"))


def test_numbers_json_cannot_carry_are_refused(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    plan = make_plan()
    nan = replace(plan, watermarks=replace(plan.watermarks, recover_pct=float("nan")))
    with pytest.raises(RefusedError, match=r"plan\.watermarks\.recover_pct"):
        _deploy(nan, root)
    huge = replace(
        plan, reasons={"x": "y"}, budget=(), engine=replace(plan.engine, n_ubatch=1 << 70)
    )
    with pytest.raises(RefusedError, match=r"plan\.engine\.n_ubatch"):
        _deploy(huge, root)


def test_thread_counts_and_sizes_are_bounded(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    plan = make_plan()
    million = replace(plan, engine=replace(plan.engine, n_threads=1_000_000))
    with pytest.raises(RefusedError, match=r"plan\.engine\.n_threads"):
        _deploy(million, root)
    negative = make_plan(memory_high_bytes=-5, memory_max_bytes=2 << 30)
    with pytest.raises(RefusedError, match=r"plan\.limits\.memory_high_bytes"):
        _deploy(negative, root)


def test_exec_words_round_trip_through_systemd(analyze: str, tmp_path: Path) -> None:
    """A program path holding % and $, and arguments holding specifiers, reach systemd intact.

    systemd-analyze verify checks that the ExecStart= program exists (an
    unescaped %b, the boot id, names another file) and resolves every
    specifier in the arguments (an unknown %Z or a lone trailing % fails).
    """
    odd = tmp_path / "a%b$c"
    odd.mkdir()
    exe = odd / "slmguard"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    args = ["serve", "%Z 100%", "$HOME ${HOME}", "q\"uo'te\\", "plain-word"]
    line = escape.exec_line([str(exe), *args], "test")
    unit = tmp_path / "odd.service"
    unit.write_text(f"[Service]\nType=oneshot\nExecStart={line}\n")
    assert verify(analyze, [unit]) == ""
    assert line.split()[0] == str(exe).replace("%", "%%")
    assert '"%%Z 100%%"' in line and '"$$HOME $${HOME}"' in line and '"q\\"uo\'te\\\\"' in line
    # The same words unescaped: systemd looks for another file and rejects the specifiers.
    unit.write_text(f"[Service]\nType=oneshot\nExecStart={exe} serve %Z 100%\n")
    complaints = verify(analyze, [unit])
    assert "not executable" in complaints or "specifier" in complaints.lower(), complaints
    for bad in (str(odd / 'x"y'), "relative/slmguard", str(odd / "sp ace")):
        with pytest.raises(RefusedError):
            escape.exec_line([bad, "serve"], "test")


def test_labels_are_one_bounded_printable_line() -> None:
    for text in HOSTILE_NAMES.values():
        out = escape.label(text)
        assert out.isprintable() and len(out) <= escape.LABEL_MAX_CHARS
        assert not set(out) & set("%\\\"'`$=[]\n\r\x00")
    assert escape.label("Qwen2.5 1.5B Instruct") == "Qwen2.5 1.5B Instruct"
    assert escape.label("通义千问 0.5B") == "通义千问 0.5B"
    assert escape.label("\n\t") == "unnamed"


def test_environment_and_file_names() -> None:
    assert escape.environment([("A", "1"), ("B", "x y")], "t") == 'A=1 "B=x y"'
    assert escape.environment([("C", 'q"%\\')], "t") == '"C=q\\"%%\\\\"'
    with pytest.raises(RefusedError):
        escape.environment([("A B", "1")], "t")
    with pytest.raises(RefusedError):
        escape.environment([("A", "1\n[Service]")], "t")
    assert escape.file_name("../../etc/passwd") == "_.._etc_passwd"
    assert escape.file_name(".hidden.gguf") == "hidden.gguf"
    assert escape.file_name("") == "model.gguf"
    long = escape.file_name("m" * 500 + ".gguf")
    assert len(long) == escape.FILE_NAME_MAX and long.endswith(".gguf")


def _injected_gguf(path: Path) -> Path:
    w = GGUFWriter(path, "llama")
    w.add_name(INJECTION + "kernel.core_pattern = |/bin/sh\n")
    w.add_uint32("llama.block_count", 2)
    w.add_uint32("llama.embedding_length", 64)
    w.add_uint32("llama.context_length", 4096)
    w.add_uint32("llama.feed_forward_length", 128)
    w.add_uint32("llama.attention.head_count", 4)
    w.add_uint32("llama.attention.head_count_kv", 2)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(500)])
    w.add_tensor("token_embd.weight", np.ones((500, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_model_file_with_an_injected_name_renders_clean_units(
    analyze: str, tmp_path: Path
) -> None:
    """From the GGUF through `plan` and `render`: the units parse with no extra key.

    The plan loader may refuse the name outright (exit 78, one line); what it
    must never do is write a unit or sysctl line from it.
    """
    model = _injected_gguf(tmp_path / "evil.gguf")
    exe = Path(sys.executable).parent / "slmguard"
    plan = tmp_path / "plan.json"

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(exe), *argv], capture_output=True, text=True, timeout=120, check=False
        )

    done = run("plan", "--model", str(model), "--board", "rk3588-4g", "--json", "--out", str(plan))
    if done.returncode != 0:
        assert done.returncode in (65, 78) and len(done.stderr.strip().splitlines()) <= 2
        return
    out = tmp_path / "out"
    done = run("render", "--plan", str(plan), "--out", str(out), "--exec", str(exe))
    if done.returncode != 0:
        assert done.returncode == 78 and "Traceback" not in done.stderr, done.stderr
        return
    unit_dir = out / "etc/systemd/system"
    units = [
        u
        for u in sorted(unit_dir.glob("*.service")) + sorted(unit_dir.glob("*.slice"))
        if not u.is_symlink()  # the masked swap services
    ]
    for unit in units:
        lines = unit.read_text().splitlines()
        assert not [ln for ln in lines if ln.startswith(("ExecStartPre", "[Service]\n"))], unit
        assert sum(ln == "[Service]" for ln in lines) <= 1, unit
    assert verify(analyze, units) == ""
    sysctl = (out / "etc/sysctl.d/99-slmguard.conf").read_text()
    assert sysctl_keys(sysctl) == ["vm.swappiness", "vm.overcommit_memory", "vm.overcommit_ratio"]
    assert "core_pattern" not in "".join(ln for ln in sysctl.splitlines() if ln[:1] != "#")
    data = json.loads((out / "etc/slmguard/plan.json").read_text())
    # Kept as data: sanitized (control characters are spaces) and in JSON.
    assert data["model"]["name"].startswith(" ".join(INJECTION.split("\n")).strip()[:20])

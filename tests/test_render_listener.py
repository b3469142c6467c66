"""A LAN listener with a per-board API key, and a Kubernetes node without slmguard's units.

- ``--listen ADDRESS[:PORT] --allow NETWORK``: the server's ExecStart= listens
  there with ``--api-key-file %d/api-key`` (a credential of the key apply makes
  on the board, 0600, never in a diff), IPAddressAllow= is localhost and the
  networks; systemd-analyze verify accepts the unit and slmguard's own parser
  its command line; apply makes the key once, rollback removes it;
- every hostile address or network is refused (64) before anything is written;
- ``--kubernetes-node``: the kernel, swap and boot settings and the model, no
  unit, slice or secret; rollback restores the root byte for byte.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from rendertrees import make_board_root, make_model_file, make_plan, run_cli, snapshot
from slmguard.cli import build_parser
from slmguard.deploy.apply import apply_plan
from slmguard.deploy.render import RenderOptions, render_files
from slmguard.deploy.rollback import rollback
from slmguard.errors import UsageError
from slmguard.plan.planfile import dumps_plan
from systemdunits import find_systemd_analyze
from systemdunits import materialize as _materialize
from systemdunits import values as _values
from systemdunits import verify as _verify

EXE = str(Path(sys.executable).parent / "slmguard")
LAN = RenderOptions(exec_path=EXE, host="0.0.0.0", port=8081, allow=("10.20.0.0/16", "fd00::/8"))


def _unit(opts: RenderOptions, name: str = "slmguard.service") -> str:
    files = {f.path: f for f in render_files(make_plan(), opts)}
    return (files[f"/etc/systemd/system/{name}"].content or b"").decode()


def test_a_lan_listener_gets_its_key_and_its_networks() -> None:
    text = _unit(LAN)
    (exec_start,) = _values(text, "Service", "ExecStart")
    _exe, *argv = exec_start.split()
    args = build_parser().parse_args(argv)
    assert (args.host, args.port, str(args.api_key_file)) == ("0.0.0.0", 8081, "%d/api-key")
    assert "api-key:/etc/slmguard/api-key" in _values(text, "Service", "LoadCredential")
    assert _values(text, "Service", "IPAddressAllow") == ["localhost 10.20.0.0/16 fd00::/8"]
    watch = _unit(LAN, "slmguard-watch.service")
    assert "--server http://127.0.0.1:8081" in watch
    key = next(f for f in render_files(make_plan(), LAN) if f.path == "/etc/slmguard/api-key")
    assert key.is_secret and key.mode == 0o600 and key.content is None
    # The default stays loopback, without a key.
    plain = _unit(RenderOptions(exec_path=EXE))
    assert "--host" not in plain and "api-key" not in plain
    assert _values(plain, "Service", "IPAddressAllow") == ["localhost"]


def test_systemd_verify_accepts_the_lan_unit(tmp_path: Path) -> None:
    analyze = find_systemd_analyze()
    units = _materialize(render_files(make_plan(), LAN), tmp_path)
    assert _verify(analyze, units) == ""


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        (RenderOptions(host="0.0.0.0"), "needs --allow NETWORK"),
        (RenderOptions(allow=("10.0.0.0/8",)), "--allow goes with --listen"),
        (RenderOptions(host="0.0.0.0 --model /etc/shadow", allow=("10/8",)), "not an IP address"),
        (RenderOptions(host="eth0", allow=("10.0.0.0/8",)), "not an IP address"),
        (RenderOptions(host="0.0.0.0", port=0, allow=("10.0.0.0/8",)), "outside 1..65535"),
        (RenderOptions(host="0.0.0.0", allow=("10.0.0.0/8\nExecStartPre=/x",)), "not an IP net"),
        (RenderOptions(host="0.0.0.0", allow=("any",)), "not an IP network"),
        (RenderOptions(host="0.0.0.0", allow=("10.0.0.0/33",)), "not an IP network"),
        (RenderOptions(host="0.0.0.0", allow=("%d",)), "not an IP network"),
    ],
)
def test_hostile_addresses_are_refused(opts: RenderOptions, needle: str) -> None:
    with pytest.raises(UsageError, match=re.escape(needle)):
        render_files(make_plan(), opts)


def test_apply_makes_the_key_once_and_rollback_removes_it(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "armbian")
    before = snapshot(root)
    first = apply_plan(make_plan(), LAN, root)
    key = root / "etc/slmguard/api-key"
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_text().strip()) >= 40
    assert key.read_text().strip() not in first.diff
    value = key.read_bytes()
    apply_plan(make_plan(), LAN, root)
    assert key.read_bytes() == value
    rollback(root)
    assert snapshot(root) == before


def test_a_kubernetes_node_gets_no_units(tmp_path: Path) -> None:
    root = make_board_root(tmp_path / "root", "extlinux")
    before = snapshot(root)
    model, size, digest = make_model_file(tmp_path / "m.gguf")
    plan = make_plan(model_path=str(model), model_bytes=size, model_sha256=digest)
    node = RenderOptions(exec_path=EXE, kubernetes_node=True)
    paths = {f.path for f in render_files(plan, node)}
    assert "/etc/sysctl.d/99-slmguard.conf" in paths and "/etc/slmguard/plan.json" in paths
    assert not {p for p in paths if p.endswith((".slice", "slmguard.service", "-token"))}
    apply_plan(plan, node, root)
    assert not (root / "etc/systemd/system/slmguard.service").exists()
    assert not (root / "etc/systemd/system/multi-user.target.wants/slmguard.service").exists()
    assert "cma=512M" in (root / "boot/extlinux/extlinux.conf").read_text()
    rollback(root)
    assert snapshot(root) == before


def testrun_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, size, digest = make_model_file(tmp_path / "m.gguf")
    plan = tmp_path / "plan.json"
    plan.write_text(
        dumps_plan(make_plan(model_path=str(model), model_bytes=size, model_sha256=digest))
    )
    out = ["render", "--plan", str(plan), "--exec", EXE]
    code, text = run_cli(
        [*out, "--out", str(tmp_path / "a"), "--listen", "[::]:8081", "--allow", "fd00::/8"], capsys
    )
    assert code == 0, text
    unit = (tmp_path / "a/etc/systemd/system/slmguard.service").read_text()
    assert "--host :: --port 8081" in unit
    for listen, needle in (("0.0.0.0:99999", "1..65535"), ("0.0.0.0:x", "1..65535")):
        code, text = run_cli([*out, "--out", str(tmp_path / "b"), "--listen", listen], capsys)
        assert code == 64 and needle in text
    code, text = run_cli([*out, "--out", str(tmp_path / "c"), "--listen", "0.0.0.0"], capsys)
    assert code == 64 and "needs --allow NETWORK" in text
    fleet = ["render", "--target", "ansible", "--plan", str(plan), "--out", str(tmp_path / "d")]
    code, text = run_cli([*fleet, "--kubernetes-node"], capsys)
    assert code == 64 and "--kubernetes-node does not apply to --target ansible" in text

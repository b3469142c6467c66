"""Doctor check ``unit.bind``: no public listen address without an API key.

Owns reading the listen address and the API key from the unit's ExecStart=
(``--host``, ``--api-key``, ``--api-key-file``) and Environment= lines, and
deciding whether an address is public (anything but loopback or a unix
socket). Pure: reads only the snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from slmguard.doctor.findings import CheckId, Evidence, Finding
from slmguard.doctor.unit import unit_check
from slmguard.host import systemd
from slmguard.host.snapshot import HostSnapshot
from slmguard.netaddr import is_loopback
from slmguard.plan.schema import Plan

KEY_FLAGS = ("--api-key", "--api-key-file")
KEY_ENV = ("SLMGUARD_API_KEY", "SLMGUARD_API_KEY_FILE", "LLAMA_API_KEY")
HOST_ENV = ("SLMGUARD_HOST", "LLAMA_ARG_HOST")


def _flag(argv: Sequence[str], names: Sequence[str]) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def is_public(host: str) -> bool:
    """True unless ``host`` is a loopback address or name (``netaddr.is_loopback``) or a
    unix socket path; a host name counts as public (it may resolve to a reachable address)."""
    return not (host.startswith(("/", "unix:")) or is_loopback(host))


@unit_check("unit.bind", "No public address without an API key")
def check_unit_bind(
    s: HostSnapshot, plan: Plan | None, unit: systemd.UnitFile, check: CheckId
) -> Finding:
    execs = unit.values("Service", "ExecStart")
    e = unit.entry("Service", "ExecStart")
    if not execs or e is None:
        return check.unknown("no ExecStart= in [Service]")
    argv = systemd.exec_argv(execs[-1])
    env = systemd.service_environment(unit)
    host = _flag(argv, ("--host",)) or next((env[k] for k in HOST_ENV if k in env), None)
    ev = [Evidence("listen address", host or "default (127.0.0.1)", e.where)]
    key = _flag(argv, KEY_FLAGS) or next((k for k in KEY_ENV if k in env), None)
    env_files = unit.values("Service", "EnvironmentFile")
    if key:
        ev.append(Evidence("API key", "configured", e.where))
    if env_files:
        ev.append(Evidence("EnvironmentFile", " ".join(env_files), str(unit.path)))
    if argv and Path(argv[0]).name == "llama-cli":
        ev.append(
            Evidence(
                "program",
                "llama-cli is the interactive client; serving with --host/--port is llama-server",
                e.where,
            )
        )
    if host is None or not is_public(host):
        return check.passed(f"listens on {host or '127.0.0.1'} (loopback)", ev)
    if key:
        return check.passed(f"listens on {host} with an API key", ev)
    fix = (
        "add `--api-key-file /etc/slmguard/api-key` to ExecStart= (file mode 0600), "
        "or listen on `--host 127.0.0.1` behind a proxy"
    )
    if env_files:
        return check.warn(
            f"listens on {host}; an API key can only come from "
            "the EnvironmentFile, which doctor did not verify",
            ev,
            fix,
        )
    return check.fail(
        f"listens on {host} with no API key: anyone on the network can use (and exhaust) the model",
        ev,
        fix,
    )

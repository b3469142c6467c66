"""Settings declared once (slmguard.options): flags, environment variables, precedence.

Tables on a small dataclass of every kind of field, then the two real users:
``ServeSettings`` (``SLMGUARD_*``) and ``WatchConfig`` (``SLMGUARD_WATCH_*``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slmguard import options
from slmguard.errors import ConfigError
from slmguard.options import option


@dataclass(frozen=True)
class Sample:
    port: int = option(8080, "TCP port")
    ratio_pct: float = option(85.0, "a line, % of the limit")
    name: str | None = option(None, "a name", flag="--called")
    mode: str = option("a", "a mode", choices=("a", "b"))
    enabled: bool = option(True, "switch")
    pids: tuple[int, ...] = option((), "repeatable", flag="--pid")
    where: Path = option(Path("/"), "test hook", hidden=True)
    token: str | None = option(None, "secret", secret=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    options.add_flags(p, Sample, "APP_")
    return p


def resolve(argv: list[str], env: dict[str, str], base: dict[str, Any] | None = None) -> Sample:
    return Sample(**options.collect(Sample, parser().parse_args(argv), env, "APP_", base))


def test_flags_env_names_and_help() -> None:
    text = parser().format_help()
    needles = ("--port PORT", "[env APP_PORT; default 8080]", "--called NAME", "[env APP_NAME]",
               "--no-enabled", "--pid PIDS", "% of the limit", "(one of a, b)")  # fmt: skip
    for needle in needles:
        assert needle in text, needle
    assert "--where" not in text  # hidden
    specs = {s.name: s for s in options.specs(Sample, "APP_")}
    assert specs["pids"].repeat and specs["pids"].kind is int
    assert specs["name"].flag == "--called" and specs["port"].flag == "--port"


def test_precedence_flag_env_base_default() -> None:
    assert resolve([], {}).port == 8080
    assert resolve([], {}, {"port": 1}).port == 1
    assert resolve([], {"APP_PORT": "2"}, {"port": 1}).port == 2
    assert resolve(["--port", "3"], {"APP_PORT": "2"}, {"port": 1}).port == 3


@pytest.mark.parametrize(
    ("env", "field", "value"),
    [
        ({"APP_ENABLED": "no"}, "enabled", False),
        ({"APP_ENABLED": "On"}, "enabled", True),
        ({"APP_PIDS": "12, 13 14"}, "pids", (12, 13, 14)),
        ({"APP_RATIO_PCT": " 90.5 "}, "ratio_pct", 90.5),
        ({"APP_WHERE": "/tmp"}, "where", Path("/tmp")),
        ({"APP_MODE": "b"}, "mode", "b"),
        ({"APP_PORT": ""}, "port", 8080),  # empty: not set
    ],
)
def test_environment_values(env: dict[str, str], field: str, value: object) -> None:
    assert getattr(resolve([], env), field) == value


def test_repeated_flags_make_a_tuple() -> None:
    assert resolve(["--pid", "1", "--pid", "2"], {"APP_PIDS": "9"}).pids == (1, 2)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"APP_PORT": "http"}, "APP_PORT='http' is not a valid int"),
        ({"APP_ENABLED": "maybe"}, "APP_ENABLED='maybe' is not a valid bool"),
        ({"APP_PIDS": "1,x"}, "APP_PIDS='1,x' is not a valid int"),
        ({"APP_MODE": "c"}, "APP_MODE='c': choose from a, b"),
    ],
)
def test_bad_environment_values_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match="^" + needle.replace("(", r"\(")):
        resolve([], env)


def test_bad_flag_values_are_argparse_errors() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--mode", "c"])


def test_redacted_hides_secrets_only_when_set() -> None:
    assert options.redacted(Sample(token="s"))["token"] == "***"
    assert options.redacted(Sample())["token"] is None


def test_every_serve_and_watch_setting_has_help_and_a_unique_env_name() -> None:
    from slmguard.settings import ENV_PREFIX, ServeSettings
    from slmguard.watch.config import ENV_PREFIX as WATCH_PREFIX
    from slmguard.watch.config import WatchConfig

    serve = options.specs(ServeSettings, ENV_PREFIX)
    watch = options.specs(WatchConfig, WATCH_PREFIX)
    for spec in [*serve, *watch]:
        assert spec.help, spec.name
    envs = [s.env for s in [*serve, *watch]]
    assert len(envs) == len(set(envs))
    assert {f.name for f in dataclasses.fields(WatchConfig)} == {s.name for s in watch}


def test_watch_reads_its_environment(tmp_path: Path) -> None:
    from slmguard.cli import build_parser
    from slmguard.commands.watch import build_config

    args = build_parser().parse_args(["watch", "--state-dir", str(tmp_path), "--interval", "7"])
    env = {"SLMGUARD_WATCH_INTERVAL_S": "3", "SLMGUARD_WATCH_KEEP_RECENT": "256",
           "SLMGUARD_WATCH_SERVER_URL": "http://127.0.0.1:9"}  # fmt: skip
    cfg = build_config(args, env)
    assert (cfg.interval_s, cfg.keep_recent, cfg.server_url) == (7.0, 256, "http://127.0.0.1:9")
    assert cfg.state_dir == tmp_path
    with pytest.raises(ConfigError, match="SLMGUARD_WATCH_SUSTAIN_S"):
        build_config(args, {"SLMGUARD_WATCH_SUSTAIN_S": "long"})

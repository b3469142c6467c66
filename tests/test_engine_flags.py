"""plan's and serve's engine flags come from one declaration: EngineSettings' fields.

Each engine setting a verb takes is the field's own flag, help and old spellings
(``plan.schema.setting``); the two verbs spell and explain a shared one the same way, an
old spelling still works and says its new name, and no other module declares one.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from slmguard import options, settings
from slmguard.cli import build_parser
from slmguard.plan.overrides import EngineOverrides, flag
from slmguard.plan.schema import EngineSettings

SRC = Path(__file__).resolve().parent.parent / "src" / "slmguard"


def _actions(verb: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[verb]
    return {s: a for a in parser._actions for s in a.option_strings}


def _declared(verb: str) -> list[dataclasses.Field[object]]:
    return [
        f for f in dataclasses.fields(EngineSettings) if verb in (f.metadata.get("verbs") or ())
    ]


@pytest.mark.parametrize("verb", ["plan", "serve"])
def test_each_engine_setting_a_verb_takes_is_its_declared_flag(verb: str) -> None:
    actions = _actions(verb)
    for f in _declared(verb):
        action = actions[flag(f.name)]
        assert action.dest == f.name and action.help is not None
        assert action.help.startswith(f.metadata["help"]), f.name
        for old in f.metadata["old"]:
            assert actions[old].dest == f.name and actions[old].help == argparse.SUPPRESS
    assert actions["--ctx"].dest == "ctx"


def test_plan_and_serve_spell_and_explain_a_shared_setting_alike() -> None:
    plan, serve = _actions("plan"), _actions("serve")
    shared = {f.name for f in _declared("plan")} & {f.name for f in _declared("serve")}
    assert shared == {"n_parallel", "kv_unified", "flash_attn", "cache_ram_mib"}
    for name in (*shared, "ctx"):
        p = plan[options.default_flag(name) if name == "ctx" else flag(name)]
        s = serve[p.option_strings[0]]
        assert p.option_strings == s.option_strings and type(p) is type(s)
        # the same words; serve's help adds its environment variable
        assert p.help is not None and s.help is not None
        assert re.sub(r" \[.*\]$", "", p.help) == re.sub(r" \[.*\]$", "", s.help)
        assert f"env {settings.env_name(name)}" in s.help and "env " not in p.help


def test_serve_takes_the_old_spellings_too() -> None:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    args = parser.parse_args(["--slots", "3", "--cache-ram", "8", "--flash-attn", "off"])
    s = settings.resolve(args, {}, None)
    assert s.overrides() == EngineOverrides(
        fields={"n_parallel": 3, "cache_ram_mib": 8, "flash_attn": False}
    )
    assert settings.deprecations(args, {}) == [
        "--slots is now --n-parallel (the old spelling still works)",
        "--cache-ram is now --cache-ram-mib (the old spelling still works)",
        "--flash-attn off is now --no-flash-attn (the old spelling still works)",
    ]


def test_no_module_declares_an_engine_flag_of_its_own() -> None:
    """No ``add_argument`` in the package names an engine setting's flag or old spelling:
    the parsers take them from the declarations (options.add_flags)."""
    taken = [*_declared("plan"), *_declared("serve")]
    spellings = {flag(f.name) for f in taken} | {old for f in taken for old in f.metadata["old"]}
    spellings |= {"--ctx"}
    found = [
        f"{path.relative_to(SRC)}: {m.group(0)}"
        for path in SRC.rglob("*.py")
        for m in re.finditer(r"add_argument\(\s*\"(--[a-z-]+)\"", path.read_text("utf-8"))
        if m.group(1) in spellings or m.group(1).removeprefix("--no-") in spellings
    ]
    assert found == []

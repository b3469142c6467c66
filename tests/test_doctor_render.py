"""doctor agrees with render: the unit render writes for a plan passes the unit checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hostboards import RK3588_HARDENED
from hosttree import build_tree
from slmguard import doctor
from slmguard.host.snapshot import collect
from slmguard.plan.planfile import dumps_plan

render_units = pytest.importorskip("slmguard.deploy.units")
planner = pytest.importorskip("slmguard.plan.planner")
boards = pytest.importorskip("slmguard.plan.boards")
presets = pytest.importorskip("slmguard.plan.presets")


def test_rendered_unit_passes_the_unit_checks(tmp_path: Path) -> None:
    facts, preset, quant = presets.preset_facts("qwen2.5-0.5b-instruct")
    plan = planner.make_plan(
        planner.PlanRequest(
            facts=facts, board=boards.get_profile("rk3588-8g"), preset=preset.name, quant=quant
        )
    )
    # The model file the deployment serves (what `render --model FILE` records).
    model = dataclasses.replace(
        plan.model, path="/var/lib/slmguard/models/qwen.gguf", sha256="ab" * 32
    )
    plan = dataclasses.replace(plan, model=model)
    unit = render_units.service_unit(plan, render_units.UnitOptions())
    tree = {
        **RK3588_HARDENED,
        "etc/systemd/system/slmguard.service": unit,
        "etc/slmguard/plan.json": dumps_plan(plan),  # what apply installs beside the unit
    }
    root = build_tree(tmp_path, tree)
    report = doctor.run_checks(collect(root), plan)
    unit_checks = {f.id: f for f in report.findings if f.id.startswith(("unit.", "cpu."))}
    assert len(unit_checks) == 8
    not_passing = {k: f.summary for k, f in unit_checks.items() if f.severity != doctor.PASS}
    assert not_passing == {}

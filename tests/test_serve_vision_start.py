"""What ``serve`` starts with a projector: the plan's, checked like the model, or its own.

``serve.startup.prepare`` checks and resolves everything before anything starts (it runs
the engine binary's ``--version`` only); these tests read what it would start: the
engine's command line and environment, the projector file's identity, the bounds and
the batch over a plan. The requests themselves: tests/test_serve_vision.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from slmguard.errors import ConfigError, ModelMismatchError, ModelNotFoundError
from slmguard.plan.inputs import PlanChoices, plan_for
from slmguard.plan.overrides import EngineOverrides, ProjectorOverrides
from slmguard.plan.schema import Plan
from slmguard.serve.llamaserver import engine_argv, engine_env
from slmguard.serve.startup import Start, prepare
from slmguard.settings import ServeSettings
from visionmodel import Projector, write_projector

pytestmark = pytest.mark.engine  # the engine binary's --version


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_projector(tmp_path_factory.mktemp("v") / "mmproj.gguf", Projector())


@pytest.fixture(scope="module")
def plan(mmproj: Path, tmp_path_factory: pytest.TempPathFactory) -> Plan:
    choices = PlanChoices(projector=ProjectorOverrides(mmproj=mmproj))
    state = tmp_path_factory.mktemp("state")
    return plan_for(Path("/"), ctx=1024, choices=choices, state_dir=state)[0]


def settings(tmp_path: Path, **kw: Any) -> ServeSettings:
    return ServeSettings(state_dir=tmp_path / "state", **kw)


def started(start: Start, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    argv = engine_argv(start.binary, start.engine, socket_path=tmp_path / "s.sock",
                       api_key_file=tmp_path / "k", alias="m")  # fmt: skip
    return argv, engine_env(start.engine, tmp_path)


def test_serve_takes_the_projector_from_the_plan(plan: Plan, tmp_path: Path) -> None:
    start = prepare(settings(tmp_path, engine=EngineOverrides(ctx=1024)), plan)
    argv, env = started(start, tmp_path)
    assert plan.projector is not None
    i = argv.index("--mmproj")
    assert argv[i + 1] == plan.projector.path and "--no-mmproj-offload" in argv
    assert "--image-max-tokens" not in argv  # gemma3: fixed tokens
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert start.vision is not None and start.vision.limits.max_images == plan.projector.max_images


def test_a_changed_projector_file_is_refused_at_start(
    plan: Plan, mmproj: Path, tmp_path: Path
) -> None:
    other = write_projector(tmp_path / "other.gguf", Projector(), seed=30)  # same size
    with pytest.raises(ModelMismatchError, match="sha256"):
        prepare(settings(tmp_path, projector=ProjectorOverrides(mmproj=other)), plan)
    assert plan.projector is not None
    moved = dataclasses.replace(plan, projector=dataclasses.replace(
        plan.projector, path=str(tmp_path / "gone.gguf")))  # fmt: skip
    with pytest.raises(ModelNotFoundError):
        prepare(settings(tmp_path), moved)


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"projector": ProjectorOverrides(bounds={"max_images": 9})},
         "--max-images 9 is above the plan's 2"),
        ({"engine": EngineOverrides(fields={"n_batch": 8, "n_ubatch": 8})},
         "n_ubatch: 8 is below the projector's 16 tokens an image"),
    ],
)  # fmt: skip
def test_flags_over_the_plan_that_break_its_images_are_refused(
    plan: Plan, tmp_path: Path, given: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigError, match=said):
        prepare(settings(tmp_path, **given), plan)


def test_lower_bounds_over_the_plan_are_served(plan: Plan, tmp_path: Path) -> None:
    start = prepare(
        settings(tmp_path, projector=ProjectorOverrides(bounds={"max_image_pixels": 1000})), plan
    )
    assert start.vision is not None and start.vision.limits.max_pixels == 1000


def test_a_plan_without_a_projector_takes_no_mmproj(
    plan: Plan, mmproj: Path, tmp_path: Path
) -> None:
    bare = dataclasses.replace(plan, projector=None)
    with pytest.raises(ConfigError, match="the plan has no vision projector"):
        prepare(settings(tmp_path, projector=ProjectorOverrides(mmproj=mmproj)), bare)


def test_without_a_plan_serve_plans_the_projector_itself(mmproj: Path, tmp_path: Path) -> None:
    s = settings(tmp_path, engine=EngineOverrides(ctx=512),
                 projector=ProjectorOverrides(mmproj=mmproj, bounds={"max_images": 1}))  # fmt: skip
    start = prepare(s)
    assert start.checked.projector is not None and start.checked.projector.max_images == 1
    assert "image_requests" in {p.name for p in start.checked.budget}
    argv, _ = started(start, tmp_path)
    assert argv[argv.index("--mmproj") + 1] == str(mmproj.resolve())
    assert start.engine.n_ubatch >= 16
    with pytest.raises(ConfigError, match="--max-images: no vision projector is served"):
        prepare(settings(tmp_path, projector=ProjectorOverrides(bounds={"max_images": 1})))

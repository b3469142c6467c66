"""Plans for every board preset, with the real model, for the fleet renderers' tests.

Each plan is made by the planner for the embedded Gemma 3 270M file on one of
``slmguard.plan.boards.PROFILES`` (``plan --model FILE --board NAME``); the
model is checked against it once per session (``planned_model``: size and
sha256) and shared. Tests needing these skip, with the reason, when the model
was not prepared (``make model``).
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from serveproc import default_model_path
from slmguard.deploy.fleet.kinds import BoardPlan, board_plans
from slmguard.deploy.modelfile import ModelSource, planned_model
from slmguard.plan.boards import PROFILES
from slmguard.plan.inputs import plan_for
from slmguard.plan.schema import Plan

BOARDS = tuple(PROFILES)
#: The server image the k8s tests render with: pinned by a digest, as render requires (no
#: image is pulled in the tests; the digest is a stand-in).
IMAGE = "registry.example/slmguard:0.1.0@sha256:" + "0" * 64


def model_path() -> Path:
    path = default_model_path()
    if not path.is_file():
        pytest.skip(f"the default model is not prepared at {path} (make model)")
    return path


@cache
def _planned(board: str) -> tuple[Plan, ModelSource]:
    plan, _ = plan_for(Path("/"), model=model_path(), board=board)
    return plan, planned_model(plan, None)


def board_plan(board: str) -> BoardPlan:
    """The plan for ``board`` with its checked model, as a one-board fleet."""
    (bp,) = board_plans([_planned(board)])
    return bp


def fleet(*boards: str) -> tuple[BoardPlan, ...]:
    return board_plans([_planned(b) for b in boards or BOARDS])


def renamed(bp: BoardPlan, board_name: str, model_name: str | None = None) -> BoardPlan:
    """The same plan with hostile names (bypassing the plan loader, as an attacker's file may)."""
    plan = replace(
        bp.plan,
        board=replace(bp.plan.board, name=board_name),
        model=replace(bp.plan.model, name=model_name if model_name is not None else board_name),
    )
    (out,) = board_plans([(plan, bp.model)])
    return out

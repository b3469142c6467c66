"""Names the fleet renderers derive from a plan's board name, and the plans they accept.

Owns turning the board name (untrusted plan text) into the names an
orchestrator keys on: a Kubernetes label value and resource-name part
(``[a-z0-9-]``, at most :data:`SLUG_MAX_CHARS`, starting and ending with a
letter or digit) and an Ansible group name (``slmguard_`` + the slug with
``_`` for ``-``). When the board name is not already such a slug (say
``"x\\n- hosts: all"`` or ``"Pi 5 (Lab)"``), the slug is the reduced name plus
the first 8 hex digits of the name's sha256, so two different names never
share a slug.

Also the rules of the plans a fleet render takes: one plan per board kind (two
plans whose boards reduce to the same slug are refused, 78), and one model per
plan: the role stages and the DaemonSet mounts the primary's file only, so a
board plan with other models (issue 39) is refused (78) before any file is read.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from slmguard.deploy.modelfile import ModelSource
from slmguard.errors import RefusedError
from slmguard.plan.boards import PROFILES
from slmguard.plan.schema import Plan

SLUG_MAX_CHARS = 40
_SLUG = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
GROUP_PREFIX = "slmguard_"


@dataclass(frozen=True)
class BoardPlan:
    """One board kind of the fleet: its plan, the checked model and its names."""

    plan: Plan
    model: ModelSource
    slug: str

    @property
    def group(self) -> str:
        """The Ansible inventory group of this board kind."""
        return GROUP_PREFIX + self.slug.replace("-", "_")

    @property
    def arch(self) -> str | None:
        """``kubernetes.io/arch`` of a named board profile; None for ``generic`` (what
        ``--board auto`` calls a host it does not know, whatever its CPU) and unknown names."""
        profile = PROFILES.get(self.plan.board.name)
        if profile is None or profile.name == "generic":
            return None
        return "arm64" if profile.isa.startswith("arm") else "amd64"


def board_slug(name: str) -> str:
    """``name`` as a label value / DNS label part (see the module docstring)."""
    if len(name) <= SLUG_MAX_CHARS and _SLUG.fullmatch(name):
        return name
    reduced = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[: SLUG_MAX_CHARS - 9]
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    reduced = reduced.rstrip("-")
    return f"{reduced}-{digest}" if reduced else f"board-{digest}"


def one_model(plan: Plan, source: str) -> Plan:
    """``plan`` when it has one model; refused (78, naming the others) when it is a board
    of several: a fleet render deploys the primary's file only."""
    if plan.models:
        names = ", ".join(m.serving.name for m in plan.models)
        raise RefusedError(
            f"{source}: a board of {len(plan.models) + 1} models (beside the primary: "
            f"{names}); the fleet renders (ansible, k8s) deploy one model per board kind",
            facts={"plan": source, "models": [m.serving.name for m in plan.models]},
            hint="deploy it with `slmguard apply --plan` on the board (render --target files "
            "shows its files), or plan each kind with one --model",
        )
    return plan


def board_plans(plans: Sequence[tuple[Plan, ModelSource]]) -> tuple[BoardPlan, ...]:
    """The fleet's board kinds, one per plan; refused (78) when two share a board."""
    seen: dict[str, str] = {}
    out = []
    for plan, model in plans:
        slug = board_slug(plan.board.name)
        if slug in seen:
            raise RefusedError(
                f"two plans are for the board {plan.board.name!r}: a fleet render takes one "
                "plan per board kind",
                facts={"board": plan.board.name, "slug": slug},
                hint="give each --plan for a different board (plan --board NAME)",
            )
        seen[slug] = plan.board.name
        if plan.projector is not None:
            raise RefusedError(
                f"the plan for {plan.board.name!r} has a vision projector, which the Ansible "
                "role and the Kubernetes manifests do not carry yet",
                facts={"projector": plan.projector.path},
                hint="deploy it with `slmguard apply` on the board, or plan without --mmproj",
            )
        out.append(BoardPlan(plan, model, slug))
    return tuple(out)

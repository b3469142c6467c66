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
plans whose boards reduce to the same slug are refused, 78), and every file a
kind deploys (the primary model, a board's other models of issue 39, the vision
projector of issue 42) installed under its own file name beside the others: two
different files that would land on one name are refused (78).
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
    """One board kind of the fleet: its plan, the checked models and its names.

    ``model`` is the primary (its ``projector`` beside it), ``others`` the board's
    other models (``plan.models``, in order), each checked as apply checks it
    (:func:`slmguard.deploy.modelfile.board_models`)."""

    plan: Plan
    model: ModelSource
    slug: str
    others: tuple[ModelSource, ...] = ()

    @property
    def extra_files(self) -> tuple[ModelSource, ...]:
        """What the kind deploys beside the primary: its other models, then the projector."""
        projector = () if self.model.projector is None else (self.model.projector,)
        return (*self.others, *projector)

    @property
    def files(self) -> tuple[ModelSource, ...]:
        """Every file the kind deploys: the primary model first."""
        return (self.model, *self.extra_files)

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


def board_plans(
    plans: Sequence[tuple[Plan, ModelSource] | tuple[Plan, ModelSource, tuple[ModelSource, ...]]],
) -> tuple[BoardPlan, ...]:
    """The fleet's board kinds, one per plan (each ``(plan, model)`` or ``(plan, model,
    others)``); refused (78) when two share a board, or two files one installed name."""
    seen: dict[str, str] = {}
    out = []
    for plan, model, *rest in plans:
        slug = board_slug(plan.board.name)
        if slug in seen:
            raise RefusedError(
                f"two plans are for the board {plan.board.name!r}: a fleet render takes one "
                "plan per board kind",
                facts={"board": plan.board.name, "slug": slug},
                hint="give each --plan for a different board (plan --board NAME)",
            )
        seen[slug] = plan.board.name
        bp = BoardPlan(plan, model, slug, rest[0] if rest else ())
        _check_names(bp)
        out.append(bp)
    return tuple(out)


def _check_names(bp: BoardPlan) -> None:
    """Every file the kind deploys lands on its own name (the board's ``MODEL_DIR``, the
    node's): the same bytes twice are one file; two different files on one name, refused."""
    by_dest: dict[str, str] = {}
    for f in bp.files:
        if by_dest.setdefault(f.dest, f.sha256) != f.sha256:
            raise RefusedError(
                f"the plan for {bp.plan.board.name!r} deploys two different files as {f.dest}",
                facts={"path": f.dest},
                hint="rename one of the files and plan again",
            )

"""A board plan's words: why its models, neighbours and resident sets are what they are.

Owns the reasons a plan of several models adds (``models``, ``neighbours``,
``resident_sets``) and its refusals (the board cannot hold its pinned models and
neighbours; an on-demand model could never be loaded; the neighbours leave no zone), each
a function of the numbers :mod:`slmguard.plan.board` found, its phrases in
:data:`PHRASES`. Pure, as :mod:`slmguard.plan.reasons` is: no arithmetic, no planner, no
host reader.
"""

from __future__ import annotations

from collections.abc import Sequence

from slmguard.errors import PlanError
from slmguard.plan.reasons import mib

PHRASES = {
    "models": "{n} models in one service, each its own engine: {each}",
    "models.each": "{name} ({role}, {residency}, priority {priority}) peak {peak}",
    "neighbours": (
        "{total} held for the board's other services ({each}), in the business slice with "
        "the business reserve {own}: MemoryMin= {business} in all, and the inference zone "
        "that much smaller"
    ),
    "resident_sets": (
        "{sets}: each below the recovery line {line} with the front and every model in it "
        "at full load{apart}"
    ),
    "resident_sets.apart": (
        "; the on-demand models take turns: a load that would leave every set evicts an "
        "idle one first"
    ),
    "refuse.pinned": "board {board}: cannot hold its pinned models and neighbours: {why}",
    "refuse.on_demand": (
        "board {board}: the on-demand model {name} (peak {peak}) could never be loaded beside "
        "the pinned models: {why}"
    ),
    "refuse.neighbours": (
        "board {board}: the neighbours ({each}, {total}) with the OS {os}, business {own} and "
        "NPU {npu} reserves leave nothing of {ram} RAM for the models"
    ),
    "refuse.neighbours.line": "; the neighbours hold {total} of it ({each})",
    "refuse.model": "board {board}: the model {name}: {why}",
}


def _each(sizes: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{name} {mib(n)}" for name, n in sizes)


def models(*, each: Sequence[tuple[str, str, str, int, int]]) -> str:
    """models: every model (name, role, residency, priority, peak), the primary first."""
    text = ", ".join(
        PHRASES["models.each"].format(
            name=name, role=role, residency=residency.replace("_", "-"), priority=priority,
            peak=mib(peak),
        )
        for name, role, residency, priority, peak in each
    )  # fmt: skip
    return PHRASES["models"].format(n=len(each), each=text)


def neighbours(*, each: Sequence[tuple[str, int]], own_bytes: int) -> str:
    """neighbours: what they hold, beside the board's own business reserve."""
    total = sum(n for _, n in each)
    return PHRASES["neighbours"].format(
        total=mib(total), each=_each(each), own=mib(own_bytes), business=mib(total + own_bytes)
    )


def resident_sets(*, sets: Sequence[tuple[Sequence[str], int]], line_bytes: int) -> str:
    """resident_sets: each set with its peak; with several, the on-demand ones take turns."""
    text = "; ".join(f"{' + '.join(names)} {mib(peak)}" for names, peak in sets)
    apart = PHRASES["resident_sets.apart"] if len(sets) > 1 else ""
    return PHRASES["resident_sets"].format(sets=text, line=mib(line_bytes), apart=apart)


def neighbours_line(*, each: Sequence[tuple[str, int]]) -> str:
    """What a refusal adds when neighbours took part of the business reserve."""
    if not each:
        return ""
    return PHRASES["refuse.neighbours.line"].format(
        total=mib(sum(n for _, n in each)), each=_each(each)
    )


def refuse_pinned(*, board: str, err: PlanError, each: Sequence[tuple[str, int]]) -> PlanError:
    """The pinned models (the primary among them) and the neighbours do not fit."""
    return PlanError(
        PHRASES["refuse.pinned"].format(board=board, why=err.message) + neighbours_line(each=each),
        need_bytes=err.need_bytes,
        have_bytes=err.have_bytes,
        hint="a smaller context or fewer slots (ctx=, slots= in --model), a model on demand "
        "(on-demand), fewer or smaller neighbours, or a board with more RAM",
    )


def refuse_on_demand(
    *, board: str, name: str, peak_bytes: int, err: PlanError, each: Sequence[tuple[str, int]]
) -> PlanError:
    """The pinned models fit, but not with the largest on-demand one beside them."""
    return PlanError(
        PHRASES["refuse.on_demand"].format(
            board=board, name=name, peak=mib(peak_bytes), why=err.message
        )
        + neighbours_line(each=each),
        need_bytes=err.need_bytes,
        have_bytes=err.have_bytes,
        hint=f"a smaller context for {name} (ctx=), fewer pinned models, or no {name}",
    )


def refuse_model(*, board: str, name: str, err: PlanError) -> PlanError:
    """A board's other model does not fit even alone."""
    return PlanError(
        PHRASES["refuse.model"].format(board=board, name=name, why=err.message),
        need_bytes=err.need_bytes,
        have_bytes=err.have_bytes,
        hint=err.hint,
    )


def refuse_neighbours(
    *, board: str, each: Sequence[tuple[str, int]], os_bytes: int, own_bytes: int,
    npu_bytes: int, ram_bytes: int,
) -> PlanError:  # fmt: skip
    """The neighbours and the reserves leave no inference zone at all."""
    total = sum(n for _, n in each)
    message = PHRASES["refuse.neighbours"].format(
        board=board, each=_each(each), total=mib(total), os=mib(os_bytes), own=mib(own_bytes),
        npu=mib(npu_bytes), ram=mib(ram_bytes),
    )  # fmt: skip
    return PlanError(
        message,
        need_bytes=total + os_bytes + own_bytes + npu_bytes,
        have_bytes=ram_bytes,
        hint="declare the neighbours' real peak (--neighbour NAME,unit=UNIT reads it) or "
        "plan for a board with more RAM",
    )

"""Read the model file and plan for the host before serving, without growing the front.

Owns :func:`probe_model` (the GGUF header's :class:`ModelFacts`, without the
per-tensor table) and :func:`plan_host` (what ``slmguard plan --board auto``
plans for this host: slots, context per slot, flash attention, batch). Both
run in a short-lived forked child (:func:`in_child`): reading a header pulls in
the ``gguf`` package and numpy, 24-30 MB the front would otherwise keep for
its whole life; the child takes them with it when it exits. The library's
errors come back as themselves (a :class:`~slmguard.errors.PlanError` keeps its
numbers), anything else as a :class:`ModelError` naming the file.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from slmguard.errors import ModelError, SlmguardError
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.planner import PlanChoices
from slmguard.plan.schema import Plan

T = TypeVar("T")


def _error_state(err: SlmguardError) -> dict[str, Any]:
    # The tree's constructors take keyword-only details, so the error travels as its
    # class, args and attributes and is rebuilt without calling __init__.
    return {"error": (type(err), err.args, dict(err.__dict__))}


def _rebuilt(state: tuple[type[SlmguardError], tuple[Any, ...], dict[str, Any]]) -> SlmguardError:
    cls, args, attrs = state
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(attrs)
    return err


def in_child(fn: Callable[[], T], *, what: Path) -> T:
    """``fn()`` run in a forked child; its result or its SlmguardError, raised here.

    ``what`` names the file a crash of the child is reported against (ModelError).
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the caller's stack
        code = 0
        try:
            os.close(read_fd)
            try:
                data: dict[str, Any] = {"value": fn()}
            except SlmguardError as err:
                data = _error_state(err)
            except Exception as err:  # report anything unexpected to the parent
                data = {"crash": f"unreadable: {err}"}
            with os.fdopen(write_fd, "wb") as out:
                pickle.dump(data, out)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as inp:
        payload = inp.read()
    os.waitpid(pid, 0)
    try:
        # Trusted: written by our own forked child a moment ago.
        data = pickle.loads(payload)
    except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError):
        data = {"crash": "the check crashed"}
    if "error" in data:
        raise _rebuilt(data["error"])
    if "crash" in data:
        raise ModelError(what, data["crash"])
    result: T = data["value"]
    return result


def _facts(path: Path) -> ModelFacts:
    from slmguard.plan.modelfacts import read_model_facts

    return dataclasses.replace(read_model_facts(path), tensors=())


def probe_model(path: Path, *, fork: bool = True) -> ModelFacts:
    """The header facts of ``path``; raises ModelNotFoundError / ModelError."""
    return in_child(lambda: _facts(path), what=path) if fork else _facts(path)


@dataclass(frozen=True)
class HostPlan:
    """The plan for this host and how it was made (for the startup line)."""

    plan: Plan
    detected_from: str
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: the board, the slots and the context per slot."""
        e = self.plan.engine
        per_slot = e.n_ctx // max(1, e.n_parallel)
        how = f" ({self.detected_from})" if self.detected_from else ""
        return (
            f"planned for this host: board {self.plan.board.name}{how}, {e.n_parallel} slot(s) "
            f"x {per_slot} tokens of context, flash attention {'on' if e.flash_attn else 'off'}, "
            f"batch {e.n_batch}"
        )


def _plan_here(
    model: Path | None, ctx: int | None, choices: PlanChoices, state_dir: Path | None
) -> HostPlan:
    from slmguard.plan.inputs import plan_for

    plan, inputs = plan_for(
        Path("/"), model=model, board="auto", ctx=ctx, choices=choices, digest=False,
        state_dir=state_dir,
    )  # fmt: skip
    e, trained = plan.engine, plan.model.n_ctx_train
    if ctx is None and trained and e.n_ctx > trained * e.n_parallel:
        # The planner rounds a slot up to 256 cells; a model trained on less gets its own.
        engine = dataclasses.replace(e, n_ctx=trained * e.n_parallel)
        plan = dataclasses.replace(plan, engine=engine)
    return HostPlan(plan, inputs.detected_from, inputs.notes)


def plan_host(
    model: Path | None,
    *,
    ctx: int | None = None,
    choices: PlanChoices | None = None,
    state_dir: Path | None = None,
    fork: bool = True,
) -> HostPlan:
    """What ``plan --board auto`` plans for ``model`` (None: the embedded one) on this
    host, honouring ``ctx`` (per slot) and ``choices`` or refusing them (PlanError,
    UsageError with the numbers); model errors as :func:`probe_model`'s."""
    choices = choices or PlanChoices()
    what = model or Path("the embedded model")
    if not fork:
        return _plan_here(model, ctx, choices, state_dir)
    return in_child(lambda: _plan_here(model, ctx, choices, state_dir), what=what)

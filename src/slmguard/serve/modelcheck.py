"""Read the model file and plan for the host before serving, without growing the front.

Owns :func:`probe_model` (the GGUF header's :class:`ModelFacts`, without the
per-tensor table) and :func:`plan_host` (what ``slmguard plan --board auto``
plans for this host: slots, context per slot, flash attention, batch), and
:func:`check_budget`: when serve's flags change a plan's memory settings (a
larger ``--ctx``, more slots, another batch or KV type), the plan re-budgeted for
them with the plan's own arithmetic (:mod:`slmguard.plan.rebudget`) against its
limits, refused with the numbers (PlanError, 78) before the engine starts or
logged. All run in a short-lived forked child (:func:`in_child`): reading a
header pulls in the ``gguf`` package and numpy, 24-30 MB the front would
otherwise keep for its whole life; the child takes them with it when it exits. The library's
errors come back as themselves (a :class:`~slmguard.errors.PlanError` keeps its
numbers), anything else as a :class:`ModelError` naming the file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from slmguard.errors import ConfigError, ModelError, PlanError, SlmguardError
from slmguard.plan.inputs import PlanChoices
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.projector import ProjectorFacts
from slmguard.plan.rebudget import Rebudget
from slmguard.plan.schema import EngineSettings, Plan
from slmguard.plan.search import MIN_CTX
from slmguard.settings import ServeSettings, engine_flags

T = TypeVar("T")
log = logging.getLogger(__name__)


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


def probe_projector(path: Path, facts: ModelFacts) -> ProjectorFacts:
    """The header facts of the vision projector ``path``, which must make embeddings of
    the model's width (``facts``); raises ModelNotFoundError / ModelError (65)."""
    from slmguard.plan.projector import check_text_model, read_projector_facts

    projector = read_projector_facts(path)
    why = check_text_model(projector, facts.n_embd)
    if why is not None:
        raise ModelError(path, why, hint="give the projector made for this model")
    return projector


#: The context per slot serve's own plan keeps where no board is recognised (the generic
#: profile: a laptop, a VM, a CI runner) unless ``--ctx`` asks: the largest that fits there
#: is a production size (2 x 32,768 tokens on a 24 GB box, 1.3 GB of KV cache for the
#: 270M model), slow to fill and more than a first run needs.
DEMO_CTX = 4096


@dataclass(frozen=True)
class HostPlan:
    """The plan for this host and how it was made (for the startup line)."""

    plan: Plan
    detected_from: str
    notes: tuple[str, ...] = ()
    demo: bool = False  # the context is DEMO_CTX (the plan's n_ctx reason says why)

    def describe(self) -> str:
        """One line: the board, the slots and the context per slot (and why, when it is
        the demo size)."""
        e = self.plan.engine
        per_slot = e.n_ctx // max(1, e.n_parallel)
        how = f" ({self.detected_from})" if self.detected_from else ""
        why = f"; context: {self.plan.reasons['n_ctx']}" if self.demo else ""
        return (
            f"planned for this host: board {self.plan.board.name}{how}, {e.n_parallel} slot(s) "
            f"x {per_slot} tokens of context, flash attention {'on' if e.flash_attn else 'off'}, "
            f"batch {e.n_batch}{why}"
        )


def _demo_sized(
    plan: Plan, model: Path | None, choices: PlanChoices, state_dir: Path | None
) -> Plan | None:
    """``plan`` (the largest context that fits an unrecognised host) made again with
    :data:`DEMO_CTX` per slot (the model's trained context if less), its reason saying so
    and what ``--ctx`` could have; None when the largest is no more than that."""
    from slmguard.plan.inputs import plan_for

    e = plan.engine
    largest = e.n_ctx // max(1, e.n_parallel)
    demo = min(DEMO_CTX, plan.model.n_ctx_train or DEMO_CTX)
    if largest <= demo:
        return None
    small, _ = plan_for(
        Path("/"), model=model, board="auto", ctx=demo, choices=choices, digest=False,
        state_dir=state_dir,
    )  # fmt: skip
    s = small.engine
    why = (
        f"no board recognised (the generic profile): a demo-sized {s.n_ctx // s.n_parallel} "
        f"per slot x {s.n_parallel} slot(s) = -c {s.n_ctx}; --ctx N asks for more (up to "
        f"{largest} per slot fits here), or serve a plan made for the board with --plan"
    )
    return dataclasses.replace(small, reasons={**small.reasons, "n_ctx": why})


def _plan_here(
    model: Path | None, ctx: int | None, choices: PlanChoices, state_dir: Path | None
) -> HostPlan:
    from slmguard.plan.inputs import plan_for

    plan, inputs = plan_for(
        Path("/"), model=model, board="auto", ctx=ctx, choices=choices, digest=False,
        state_dir=state_dir,
    )  # fmt: skip
    demo = None
    if ctx is None and plan.board.name == "generic":
        demo = _demo_sized(plan, model, choices, state_dir)
    plan = demo or plan
    e, trained = plan.engine, plan.model.n_ctx_train
    if ctx is None and trained and e.n_ctx > trained * e.n_parallel:
        # The planner rounds a slot up to 256 cells; a model trained on less gets its own.
        engine = dataclasses.replace(e, n_ctx=trained * e.n_parallel)
        plan = dataclasses.replace(plan, engine=engine)
    return HostPlan(plan, inputs.detected_from, inputs.notes, demo=demo is not None)


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


MiB = 1 << 20


def _mib(n: int) -> str:
    return f"{n / MiB:,.0f} MiB"


def _rebudget_here(plan: Plan, engine: EngineSettings, model: Path) -> Rebudget:
    from slmguard.plan.modelfacts import read_model_facts
    from slmguard.plan.projector import VisionInput, read_projector_facts
    from slmguard.plan.rebudget import rebudget

    v = plan.projector
    vision = None if v is None else VisionInput(read_projector_facts(Path(v.path)), v)
    try:
        return rebudget(plan, read_model_facts(model), engine, vision)
    except ValueError as err:  # settings the budget cannot hold (validate refuses them first)
        raise ConfigError(f"the engine settings cannot be budgeted: {err}") from err


def rebudget_plan(
    plan: Plan, engine: EngineSettings, model: Path, *, fork: bool = True
) -> Rebudget | None:
    """``plan`` re-budgeted for ``engine`` (:func:`slmguard.plan.rebudget.rebudget`), the
    model's header and tensor table read in a child; None when ``engine`` changes nothing
    the plan's budget depends on."""
    from slmguard.plan.rebudget import changed_fields

    if not changed_fields(plan.engine, engine):
        return None
    if not fork:
        return _rebudget_here(plan, engine, model)
    return in_child(lambda: _rebudget_here(plan, engine, model), what=model)


def check_budget(
    plan: Plan,
    s: ServeSettings,
    engine: EngineSettings,
    model: Path,
    *,
    what: str | None = None,
    fork: bool = True,
) -> Plan:
    """The plan to serve ``engine`` with: ``plan`` itself when serve's settings change
    nothing its budget depends on; else ``plan`` re-budgeted for them (logged), or a
    PlanError (78) naming the flags, with what they need against the plan's limits and
    the largest ``--ctx`` that fits. ``what`` names the plan (default: its board)."""
    r = rebudget_plan(plan, engine, model, fork=fork)
    if r is None:
        return plan
    what = what or f"the plan for board {plan.board.name}"
    flags = engine_flags(s, r.changed)
    if not r.fits:
        raise _refusal(plan, r, flags, what)
    commit = (
        f"; commit charge {_mib(r.commit_bytes)} (the plan's {_mib(r.planned_commit_bytes)})"
        if r.commit_limit_bytes is not None
        else ""
    )
    log.info(
        "re-budgeted %s for %s: planned peak %s (the plan's %s), below its recovery line %s%s",
        what, flags, _mib(r.peak_bytes), _mib(r.planned_peak_bytes), _mib(r.line_bytes), commit,
    )  # fmt: skip
    return r.plan


def _refusal(plan: Plan, r: Rebudget, flags: str, what: str) -> PlanError:
    """One message: the flags, what they need against which limit of the plan, and the
    largest context per slot that fits with the rest of them."""
    e = plan.engine
    head = f"{flags} over {what} ({e.n_parallel} slot(s) x {e.n_ctx_slot} tokens of context)"
    if not r.peak_fits:
        limits = plan.limits
        outside = (
            f" + {_mib(limits.device_bytes)} of GPU buffers outside the cgroup"
            if limits.device_bytes
            else ""
        )
        why = (
            f"the re-budgeted peak is {_mib(r.peak_bytes)} (the plan's "
            f"{_mib(r.planned_peak_bytes)}) but the plan's recovery line is "
            f"{_mib(r.line_bytes)} ({plan.watermarks.recover_pct:g}% of MemoryHigh "
            f"{_mib(limits.memory_high_bytes)}{outside})"
        )
        need, have = r.peak_bytes, r.line_bytes
    elif not r.start_fits:
        limit = r.start_limit_bytes or 0
        parts = ", ".join(p.name for p in r.plan.first_start)
        why = (
            f"a cold first start (Mesa's shader cache empty) would hold {_mib(r.start_bytes)}, "
            f"the re-budgeted peak {_mib(r.peak_bytes)} + {parts}, but the plan's MemoryMax "
            f"is {_mib(plan.limits.memory_max_bytes)}"
            + (
                f" (+ {_mib(plan.limits.device_bytes)} of GPU buffers outside the cgroup)"
                if plan.limits.device_bytes
                else ""
            )
        )
        need, have = r.start_bytes, limit
    else:
        line = r.commit_line_bytes or 0
        where = (
            "the plan's own charge (written with an older headroom), above "
            if line == r.planned_commit_bytes
            else ""
        )
        why = (
            f"the re-budgeted commit charge is {_mib(r.commit_bytes)} (the plan's "
            f"{_mib(r.planned_commit_bytes)}), over {_mib(line)}: {where}"
            f"{plan.watermarks.recover_pct:g}% of the {_mib(r.commit_limit_bytes or 0)} "
            f"the plan's vm.overcommit_ratio {plan.kernel.overcommit_ratio} admits (mode 2, "
            "no swap), where the governor would stop shedding"
        )
        need, have = r.commit_bytes, line
    slots = r.plan.engine.n_parallel
    if r.largest_ctx is not None:
        largest = f"; the largest --ctx that fits with {slots} slot(s) is {r.largest_ctx}"
        hint = f"give --ctx {r.largest_ctx} or less"
    else:
        largest = f"; no --ctx from {MIN_CTX} up fits with {slots} slot(s) and the rest"
        hint = "give fewer --n-parallel slots or the plan's own settings"
    return PlanError(
        f"{head}: {why}{largest}",
        need_bytes=need,
        have_bytes=have,
        hint=f"{hint}, or re-plan for what you need (slmguard plan --ctx N --n-parallel N) and "
        "serve that plan",
    )

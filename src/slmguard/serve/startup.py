"""What one server starts with, resolved and checked before anything starts.

Owns :func:`prepare` and the one frozen record it makes, :class:`Start`, which
:func:`~slmguard.serve.server.build_server` builds the server from: the plan whose budget
was checked (the operator's ``--plan``, or the plan made for this host without one:
:func:`host_choices` and :func:`~slmguard.serve.modelcheck.plan_host`), the engine's whole
settings (:class:`~slmguard.serve.llamaserver.EngineConfig`: that plan's
:class:`~slmguard.plan.schema.EngineSettings` with serve's flags over them, and the model
file), the binary (and whether it bounds a grammar's work), the model's facts and the
secrets; for a board's plan (issue 39), each further model of ``plan.models`` checked the
same way (:class:`BoardStart`: its planned file's size and sha256, its header, its
context, its backend; serve's engine flags are the primary's alone, and the binary is
one for all). Each check raises its error (and exit status) here, in order; nothing is
started but the short-lived forked checks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from slmguard import paths
from slmguard.engines import grammar_bound
from slmguard.errors import ConfigError, EngineUnavailableError, PlanError, UnsafeBindError
from slmguard.netaddr import is_loopback
from slmguard.plan.inputs import PlanChoices
from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.overrides import ProjectorOverrides, projector_flag
from slmguard.plan.relations import projector_problem
from slmguard.plan.residency import PlannedModel, planned_models
from slmguard.plan.schema import EngineSettings, Plan, ProjectorSpec, Serving
from slmguard.serve import modelcheck
from slmguard.serve.llamaserver import (
    EngineConfig,
    check_backend,
    engine_version,
    find_llama_server,
)
from slmguard.serve.vision import ServedVision
from slmguard.settings import (
    ServeSettings,
    Tokens,
    admin_token,
    api_key,
    check_engine,
    engine_flags,
    engine_settings,
)

log = logging.getLogger(__name__)

# What the front imports from the serve extra (pyproject.toml), checked before the
# model loads so a missing one is one line, not a traceback after a minute.
SERVE_MODULES = (
    ("fastapi", "the web stack (fastapi)"),
    ("uvicorn", "the web stack (uvicorn)"),
    ("prometheus_client", "prometheus-client"),
)
#: The engine settings serve's flags ask the host's planner for (without ``--plan``); the
#: others are put over the plan it makes and re-budgeted (as over a plan file).
HOST_PLANNED = ("n_parallel", "flash_attn", "kv_unified", "cache_ram_mib")


@dataclass(frozen=True)
class Start:
    """Everything a server is built from, checked.

    ``checked`` is the plan whose budget the engine's settings were checked against, with
    those settings as its engine (re-budgeted when serve's flags changed what its budget
    depends on); ``engine`` is that ``checked.engine`` for this model file: what the
    engine is started with (an engine's whole settings: a server of several engines
    would hold one per model). ``plan`` is the operator's (``--plan``) as re-budgeted,
    whose limits and memory model the governor takes; None for a plan made for this host
    (the governor keeps its defaults).
    """

    settings: ServeSettings
    checked: Plan
    engine: EngineConfig
    plan: Plan | None
    binary: Path
    version: str
    model_path: Path
    sha256: str | None
    embedded: bool  # the embedded (base) model
    facts: ModelFacts
    tokens: Tokens
    state_dir: Path
    grammar_bound: bool  # the binary stops a grammar past its work bound (its --help)
    board: tuple[BoardStart, ...] = ()  # a board plan's further models, checked
    vision: ServedVision | None = None  # the projector served (checked), its image bounds

    @property
    def serving(self) -> Serving | None:
        """How the plan serves the primary model (None: a one-model plan, or none)."""
        return self.plan.serving if self.plan is not None else None


@dataclass(frozen=True)
class BoardStart:
    """One further model of a board's plan, checked: how it is served, its engine's
    whole settings (the plan's, no flag over them), its file and facts, its planned peak,
    and the plan with its engine and budget in the primary's place (its memory model)."""

    serving: Serving
    engine: EngineConfig
    model_path: Path
    sha256: str | None
    facts: ModelFacts
    peak_bytes: int
    plan: Plan


def prepare(settings: ServeSettings, plan: Plan | None = None) -> Start:
    """Check and resolve everything ``settings`` and ``plan`` (None: plan this host) start
    a server with; raises the error of the first check that fails (see
    :mod:`slmguard.serve.server` for the list)."""
    s = settings
    state_dir = s.state_dir or paths.state_dir()
    tokens = _tokens(s)
    check_serve_stack(s)  # a missing web stack is one line (69) before any model work
    base = plan if plan is not None else host_plan(s)
    engine = engine_settings(base.engine, s)
    check_engine(engine)  # the flags over this plan's settings (78)
    binary = _engine_binary(s, plan)
    version = engine_version(binary)
    bounded = _grammar_bound(binary)
    check_backend(binary, engine)  # a GPU plan on a binary without that backend: 78 now
    model_path, sha256 = _model_file(s, plan, state_dir)
    projector = _projector(s, plan, base, state_dir)  # checked like the model (65/66/78)
    facts = modelcheck.probe_model(model_path)
    from slmguard.default_model import is_default_model, stamped_digest

    # The base-model note on every path: planned, given with --model, or embedded.
    embedded = is_default_model(sha256 or stamped_digest(model_path))
    check_context(engine, facts)
    what = None if plan is not None else "the plan for this host"
    vision = _served_vision(s, projector, facts)
    base = dataclasses.replace(base, projector=projector)
    budgeted = modelcheck.check_budget(base, s, engine, model_path, what=what)  # or 78
    checked = dataclasses.replace(budgeted, engine=engine)
    _check_batch(s, checked)
    config = EngineConfig.of(
        checked.engine,
        model_path=str(model_path.resolve()),
        chat_template_file=str(s.chat_template_file.resolve()) if s.chat_template_file else None,
        pooling_type=facts.pooling_type,
        projector=projector,
    )
    board = tuple(
        _board_model(budgeted, planned, binary, state_dir)
        for planned in (planned_models(budgeted)[1:] if plan is not None else ())
    )
    return Start(
        settings=s, checked=checked, engine=config, plan=budgeted if plan is not None else None,
        binary=binary, version=version, model_path=model_path, sha256=sha256,
        embedded=embedded, facts=facts, tokens=tokens, state_dir=state_dir, board=board,
        vision=vision, grammar_bound=bounded,
    )  # fmt: skip


def _board_model(plan: Plan, planned: PlannedModel, binary: Path, state_dir: Path) -> BoardStart:
    """A further model of a board's plan, checked as the primary is: its planned file
    (size and sha256: 65/66), its header, its context per slot (78), its backend (78)."""
    from slmguard.plan.model import verify_planned_model

    own = dataclasses.replace(plan, model=planned.model, engine=planned.engine,
                              budget=planned.budget, projector=None)  # the primary's  # fmt: skip
    path = verify_planned_model(own, state_dir=state_dir)
    facts = modelcheck.probe_model(path)
    check_engine(planned.engine)
    check_context(planned.engine, facts)
    check_backend(binary, planned.engine)
    config = EngineConfig.of(planned.engine, model_path=str(path.resolve()),
                             pooling_type=facts.pooling_type)  # fmt: skip
    return BoardStart(
        serving=planned.serving, engine=config, model_path=path, sha256=planned.model.sha256,
        facts=facts, peak_bytes=planned.peak_bytes, plan=own,
    )  # fmt: skip


def _projector(
    s: ServeSettings, plan: Plan | None, base: Plan, state_dir: Path
) -> ProjectorSpec | None:
    """The vision projector to serve: the plan's, its file (or ``--mmproj``) checked
    against its size and sha256 (65/66; ``--mmproj`` for a plan without one: 78), with the
    image bounds given if they are the plan's or lower (78); without a plan, the one the
    host's plan was made with. Bounds given without any projector: 78."""
    given = s.projector
    if plan is not None:
        from slmguard.plan.model import projector_for_plan

        spec = projector_for_plan(plan, given.mmproj, state_dir=state_dir)
    else:
        spec = base.projector
    if spec is None:
        if given.bounds:
            name = next(iter(given.bounds))
            raise ConfigError(f"{projector_flag(name)}: no vision projector is served "
                              "(--mmproj FILE, or a plan made with it)")  # fmt: skip
        return None
    for name, value in given.bounds.items():
        planned = getattr(spec, name)
        if plan is not None and value > planned:
            raise ConfigError(
                f"{projector_flag(name)} {value} is above the plan's {planned}: the plan's "
                "budget holds its own bounds",
                hint=f"re-plan with {projector_flag(name)} {value} and serve that plan",
            )
    return given.over(spec)


def _served_vision(
    s: ServeSettings, spec: ProjectorSpec | None, facts: ModelFacts
) -> ServedVision | None:
    """The projector's header read (its width the model's, its tokens the plan's: 65/78)."""
    if spec is None:
        return None
    path = Path(spec.path)
    projector = modelcheck.probe_projector(path, facts)
    if projector.tokens_per_image != spec.tokens_per_image:
        raise ConfigError(
            f"{path}: the projector makes {projector.tokens_per_image} tokens an image, the "
            f"plan budgets {spec.tokens_per_image}",
            hint="re-run `slmguard plan --mmproj FILE`",
        )
    return ServedVision(spec, projector)


def _check_batch(s: ServeSettings, checked: Plan) -> None:
    """Serve's batch flags over a plan with a projector keep an image in one ubatch (78)."""
    why = projector_problem(checked)
    if why is not None:
        flags = engine_flags(s, ("n_batch", "n_ubatch"))
        raise ConfigError(f"{flags}: {why}", hint="leave n_batch and n_ubatch to the plan")


def _grammar_bound(binary: Path) -> bool:
    """Whether the engine build stops a request whose grammar needs too much work per
    token (slmguard's engine patch, ``--grammar-max-work``), said at start either way."""
    bounded = grammar_bound(binary)
    if bounded:
        log.info("engine %s bounds a grammar's work per token (--grammar-max-work): an "
                 "ambiguous grammar is refused alone, 400 naming its field", binary)  # fmt: skip
    else:
        log.warning(
            "engine %s has no grammar bound (a build without slmguard's engine patch): an "
            "ambiguous grammar or JSON schema can stall every client's decoding until the "
            "liveness check restarts the engine; grammars and schemas are pre-checked by "
            "simulating its parse stacks, best effort (docs/serve.md, 'Constrained "
            "decoding')", binary,
        )  # fmt: skip
    return bounded


def host_choices(s: ServeSettings) -> tuple[Path | None, int | None, PlanChoices]:
    """What serve asks the host's planner for when there is no plan: the model, the
    context per slot and the engine settings of :data:`HOST_PLANNED` given. The
    deprecated ``--n-ctx`` keeps its meaning: that total over the ``--n-parallel`` slots
    (1 unless given)."""
    e = s.overrides()
    fixed = {k: e.get(k) for k in HOST_PLANNED if e.get(k) is not None}
    ctx = e.ctx
    total = e.get("n_ctx")
    if total is not None:
        fixed.setdefault("n_parallel", 1)
        ctx = total // fixed["n_parallel"] or None  # none left: refused with the flags
    projector = s.projector if s.projector.mmproj is not None else ProjectorOverrides()
    return s.model, ctx, PlanChoices(engine=fixed, projector=projector)


def host_plan(s: ServeSettings) -> Plan:
    """The plan for this host (``plan --board auto``) with what serve's flags ask of it,
    said in the log as it is made."""
    model, ctx, choices = host_choices(s)
    host = modelcheck.plan_host(model, ctx=ctx, choices=choices, state_dir=s.state_dir)
    for note in host.notes:
        log.warning("%s", note)
    log.info("%s", host.describe())
    return host.plan


def _model_file(s: ServeSettings, plan: Plan | None, state_dir: Path) -> tuple[Path, str | None]:
    """The model file and its known sha256: the plan's (or ``--model`` checked against
    it: 65/66/78), else ``--model``, else the embedded model (assembled once)."""
    from slmguard.default_model import ensure_default_model, stamped_digest

    if plan is not None:
        from slmguard.plan.model import model_for_plan

        planned = model_for_plan(plan, s.model, state_dir=state_dir)
        return Path(str(planned.path)), planned.sha256
    if s.model is not None:
        return s.model, None
    path = ensure_default_model(paths.model_dir())
    return path, stamped_digest(path)


def check_context(engine: EngineSettings, facts: ModelFacts) -> None:
    """A context per slot beyond the model's trained context is refused (78) before the
    engine starts, with the numbers (llama.cpp would try to allocate it and fail late)."""
    if facts.n_ctx_train and engine.n_ctx_slot > facts.n_ctx_train:
        raise PlanError(
            f"a context of {engine.n_ctx_slot:,} tokens per slot ({engine.n_ctx:,} in all, "
            f"{engine.n_parallel} slot(s)) is beyond {facts.arch}'s trained context of "
            f"{facts.n_ctx_train:,} tokens",
            hint=f"give --ctx {facts.n_ctx_train} or less (tokens per slot)",
        )


def _tokens(s: ServeSettings) -> Tokens:
    """The API key and the admin token (they must differ: 78); an API key is required off
    loopback (78)."""
    tokens = Tokens(api_key(s), admin_token(s))
    if not is_loopback(s.host) and not tokens.api_key:
        raise UnsafeBindError(s.host)
    return tokens


def _engine_binary(s: ServeSettings, plan: Plan | None) -> Path:
    """The engine binary: the operator's (``--llama-server``, its variable), else the one
    slmguard selects. A plan names an executable only to confirm it: a plan is edited by
    hand and copied between machines, so one naming another binary is refused (78) before
    anything runs it."""
    if s.llama_server is not None:
        return find_llama_server(s.llama_server)
    planned = plan.engine.llama_server if plan is not None else None
    if planned is None:
        return find_llama_server(None)
    try:
        selected: Path | None = find_llama_server(None)
    except EngineUnavailableError:
        selected = None
    if selected is None or not _same_file(Path(planned), selected):
        raise ConfigError(
            f"the plan's engine.llama_server {planned} is not the engine slmguard selects "
            f"({selected or 'none found'}); a plan does not choose the executable to run",
            hint=f"to run it, pass --llama-server {planned}",
        )
    return selected


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def check_serve_stack(s: ServeSettings) -> None:
    """The serve extra's modules (69) and the chat template file (78), before the model loads."""
    for module, component in SERVE_MODULES:
        if importlib.util.find_spec(module) is None:
            raise EngineUnavailableError(component)
    if s.chat_template_file is not None and not s.chat_template_file.is_file():
        raise ConfigError("--chat-template-file: no such file", path=s.chat_template_file)

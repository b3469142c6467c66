"""The relations between a plan's fields, checked once each field has passed its own rule.

Owns :data:`RELATIONS`: functions of a :class:`~slmguard.plan.schema.Plan`, each
returning the first problem it finds as one line naming the field path
(``plan.engine.n_ubatch: 1024 is above n_batch 512``) or None: memory limits ordered and
within the board's RAM, the prompt cache within the memory limit, watermarks ordered and
the lowest at least :data:`MIN_WATERMARK_PCT`, n_ubatch <= n_batch, offload with a
backend and a device, CPU lists within board.cpus, a projector's images in one ubatch
(:func:`projector_problem`), and a board's models, names, neighbours
(:func:`neighbours_bytes`) and resident sets. Pure: it declares no field
(:mod:`slmguard.plan.schema`), reads and raises nothing (:mod:`slmguard.plan.planfile`
turns a problem into a ConfigError) and does no arithmetic beyond comparing fields.
"""

from __future__ import annotations

from collections.abc import Callable

from slmguard.plan.schema import (
    FIRST_START_PARTS,
    OWN_UNITS,
    EngineSettings,
    ModelSpec,
    Plan,
    Serving,
)
from slmguard.plan.text import shown


# Relations between fields, checked after every field has passed its own rule.
# Each returns the problem (with the field path) or None.
def _memory_order(p: Plan) -> str | None:
    lim = p.limits
    if lim.memory_high_bytes > lim.memory_max_bytes:
        return (
            f"plan.limits.memory_high_bytes: {lim.memory_high_bytes} is above "
            f"memory_max_bytes {lim.memory_max_bytes}"
        )
    if lim.memory_max_bytes > p.board.ram_bytes:
        return (
            f"plan.limits.memory_max_bytes: {lim.memory_max_bytes} is above the board's "
            f"ram_bytes {p.board.ram_bytes}"
        )
    if lim.memory_max_bytes + lim.device_bytes > p.board.ram_bytes:
        return (
            f"plan.limits.device_bytes: {lim.device_bytes} beside memory_max_bytes "
            f"{lim.memory_max_bytes} is above the board's ram_bytes {p.board.ram_bytes}"
        )
    cache = p.engine.cache_ram_mib << 20
    if cache > lim.memory_max_bytes:
        return (
            f"plan.engine.cache_ram_mib: {p.engine.cache_ram_mib} MiB of prompt cache is above "
            f"memory_max_bytes {lim.memory_max_bytes} (the cache is budgeted in full)"
        )
    for name in ("os_reserve_bytes", "business_reserve_bytes"):
        if getattr(lim, name) > p.board.ram_bytes:
            return f"plan.limits.{name}: {getattr(lim, name)} is above the board's RAM"
    if p.board.npu_reserve_bytes > p.board.ram_bytes:
        return f"plan.board.npu_reserve_bytes: {p.board.npu_reserve_bytes} is above its RAM"
    if p.kernel.cma_bytes is not None and p.kernel.cma_bytes > p.board.ram_bytes:
        return f"plan.kernel.cma_bytes: {p.kernel.cma_bytes} is above the board's RAM"
    return None


#: The lowest governor line a plan may hold, percent of the memory limit: below it the
#: governor sheds an idle engine (a plan is sized to fill its limit), so such a line is a
#: slip (0.85 for 85, 0.001), not a policy.
MIN_WATERMARK_PCT = 10.0


def _watermark_order(p: Plan) -> str | None:
    w = p.watermarks
    if w.recover_pct < MIN_WATERMARK_PCT:
        return (
            f"plan.watermarks.recover_pct: {w.recover_pct:g} is below {MIN_WATERMARK_PCT:g} "
            "(percent of the memory limit, the lowest line: the governor would shed an idle "
            "engine)"
        )
    if not 0 < w.recover_pct < w.shed_pct <= w.degrade_pct <= w.critical_pct <= 100:
        return (
            "plan.watermarks: need 0 < recover_pct < shed_pct <= degrade_pct <= critical_pct "
            f"<= 100, got {w.recover_pct:g} / {w.shed_pct:g} / {w.degrade_pct:g} / "
            f"{w.critical_pct:g}"
        )
    return None


def _engine_order(p: Plan) -> str | None:
    return _engine_problem(p.engine, "plan.engine")


def _engine_problem(e: EngineSettings, where: str) -> str | None:
    if e.n_ubatch > e.n_batch:
        return f"{where}.n_ubatch: {e.n_ubatch} is above n_batch {e.n_batch}"
    if e.n_parallel > e.n_ctx:
        return f"{where}.n_parallel: {e.n_parallel} slots for n_ctx {e.n_ctx}"
    return None


def _offload(p: Plan) -> str | None:
    return _offload_problem(p.engine, p.model, "plan.engine")


def _offload_problem(e: EngineSettings, model: ModelSpec, where: str) -> str | None:
    """Layers on a device need a backend and a device, and exist in the model."""
    if e.n_gpu_layers > model.n_layer + 1:
        return (
            f"{where}.n_gpu_layers: {e.n_gpu_layers} is above the model's "
            f"{model.n_layer} layers + the output layer"
        )
    if e.n_gpu_layers and e.backend == "cpu":
        return f"{where}.n_gpu_layers: {e.n_gpu_layers} layers offloaded by backend cpu"
    if e.n_gpu_layers and e.device == "none":
        return f"{where}.n_gpu_layers: {e.n_gpu_layers} layers offloaded to device none"
    if e.backend == "cpu" and e.device not in (None, "none"):
        return f"{where}.device: {e.device} with backend cpu"
    return None


def _first_start(p: Plan) -> str | None:
    """First-start parts are the declared ones, once each, and never in the budget."""
    seen: set[str] = set()
    for i, part in enumerate(p.first_start):
        if part.name not in FIRST_START_PARTS or part.name in seen:
            return (
                f"plan.first_start[{i}].name: {shown(part.name)} is not a first-start part "
                f"({', '.join(FIRST_START_PARTS)}, once each)"
            )
        seen.add(part.name)
    for i, part in enumerate(p.budget):
        if part.name in FIRST_START_PARTS:
            return f"plan.budget[{i}].name: {part.name} is a first-start part (plan.first_start)"
    return None


def _cpu_sets(p: Plan) -> str | None:
    cpus = set(p.board.cpus)
    for name, values in (("board.big_cores", p.board.big_cores), ("cpu_affinity", p.cpu_affinity)):
        extra = sorted(set(values) - cpus)
        if extra:
            return (
                f"plan.{name}: CPU {extra[0]} is not in board.cpus "
                f"({', '.join(map(str, sorted(cpus)))})"
            )
    return None


def projector_problem(p: Plan) -> str | None:
    """A projector's images decode whole in one ubatch: llama.cpp asserts ``n_ubatch >=
    n_tokens`` for non-causal attention (SIGABRT), and a batch larger than the ubatch would
    split an image across ubatches; ``--image-max-tokens`` only where the type uses it."""
    v, e = p.projector, p.engine
    if v is None:
        return None
    if e.n_ubatch < v.tokens_per_image:
        return (
            f"plan.engine.n_ubatch: {e.n_ubatch} is below the projector's {v.tokens_per_image} "
            "tokens an image (decoded in one ubatch: llama.cpp aborts on a smaller one)"
        )
    if e.n_batch != e.n_ubatch:
        return (
            f"plan.engine.n_batch: {e.n_batch} with a projector must equal n_ubatch "
            f"{e.n_ubatch} (an image batch is decoded in one ubatch)"
        )
    if v.image_max_tokens is not None and v.fixed_tokens:
        return (
            f"plan.projector.image_max_tokens: a {v.projector_type} projector makes "
            f"{v.tokens_per_image} tokens an image whatever its size; the engine ignores it"
        )
    if v.offload and (e.n_gpu_layers == 0 or e.backend == "cpu"):
        return "plan.projector.offload: true but the plan offloads no layer to a GPU"
    return None


def _model_source(p: Plan) -> str | None:
    return _source_problem(p.model, "plan.model")


def _source_problem(model: ModelSpec, where: str) -> str | None:
    if model.path is None and model.preset is None:
        return f"{where}: names neither a file (path) nor a preset"
    return None


# -- The board's relations (issue 39): none of them says anything about a one-model plan.


def _board_shape(p: Plan) -> str | None:
    """Several models need the primary's serving; the primary is pinned; idle unloading is
    for on-demand models; each model's engine and source hold as the primary's do."""
    if p.models and p.serving is None:
        return "plan.serving: a plan with several models says how the primary one is served"
    if p.serving is not None and p.serving.residency != "pinned":
        return (
            f"plan.serving.residency: {p.serving.residency} (the primary model is pinned: "
            "its budget holds the front and the reserves)"
        )
    for where, serving in _servings(p):
        if serving.idle_unload_s and serving.residency != "on_demand":
            return (
                f"{where}.idle_unload_s: {serving.idle_unload_s} for a {serving.residency} "
                "model (only an on_demand one is unloaded when idle)"
            )
    for i, m in enumerate(p.models):
        where = f"plan.models[{i}]"
        why = (
            _engine_problem(m.engine, f"{where}.engine")
            or _offload_problem(m.engine, m.model, f"{where}.engine")
            or _source_problem(m.model, f"{where}.model")
        )
        if why:
            return why
    return None


def _servings(p: Plan) -> list[tuple[str, Serving]]:
    """(field path, serving) of every model that has one: the primary first."""
    out = [("plan.serving", p.serving)] if p.serving is not None else []
    return out + [(f"plan.models[{i}].serving", m.serving) for i, m in enumerate(p.models)]


def _served_names(p: Plan) -> str | None:
    """No two models answer to the same name (a client's ``model`` picks one)."""
    seen: dict[str, str] = {}
    for where, serving in _servings(p):
        for name in serving.names:
            if name in seen:
                return f"{where}: the name {shown(name)} is also {seen[name]}'s"
            seen[name] = where
    return None


def _neighbour_relations(p: Plan) -> str | None:
    """Neighbours have distinct names and units, none of slmguard's own, and the business
    reserve holds their memory (render gives the business slice that much MemoryMin=)."""
    names: set[str] = set()
    units: set[str] = set()
    for i, n in enumerate(p.neighbours):
        where = f"plan.neighbours[{i}]"
        if n.name in names:
            return f"{where}.name: {shown(n.name)} appears twice"
        if n.unit is not None and n.unit in units:
            return f"{where}.unit: {shown(n.unit)} appears twice"
        if n.unit in OWN_UNITS:
            return f"{where}.unit: {shown(n.unit)} is one of slmguard's own units"
        names.add(n.name)
        units.add(n.unit or "")
    held = neighbours_bytes(p)
    if held > p.limits.business_reserve_bytes:
        return (
            f"plan.neighbours: {held} bytes declared, above the business reserve "
            f"plan.limits.business_reserve_bytes {p.limits.business_reserve_bytes} that holds them"
        )
    return None


def _resident_set_relations(p: Plan) -> str | None:
    """Each set names models of the plan, every pinned one among them; every on-demand
    model is in some set (else it could never be loaded)."""
    servings = [s for _, s in _servings(p)]
    known = {s.name for s in servings}
    pinned = {s.name for s in servings if s.residency == "pinned"}
    if p.resident_sets and not p.models:
        return "plan.resident_sets: a plan of one model has no resident sets"
    for i, rs in enumerate(p.resident_sets):
        unknown = [m for m in rs.models if m not in known]
        if unknown:
            return f"plan.resident_sets[{i}].models: {shown(unknown[0])} is no model of the plan"
        missing = sorted(pinned - set(rs.models))
        if missing:
            return (
                f"plan.resident_sets[{i}].models: the pinned model {shown(missing[0])} is missing"
            )
    if p.models:
        placed = {m for rs in p.resident_sets for m in rs.models}
        for where, s in _servings(p):
            if s.name not in placed:
                return f"{where}: {shown(s.name)} is in no resident set (it could never be loaded)"
    return None


def neighbours_bytes(plan: Plan) -> int:
    """The memory the plan's neighbours hold, together."""
    return sum(n.memory_bytes for n in plan.neighbours)


RELATIONS: tuple[Callable[[Plan], str | None], ...] = (
    _memory_order,
    _watermark_order,
    _engine_order,
    _offload,
    _first_start,
    _cpu_sets,
    _model_source,
    projector_problem,
    _board_shape,
    _served_names,
    _neighbour_relations,
    _resident_set_relations,
)

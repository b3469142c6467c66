"""What the bench measures: a plan, its model and the engine, resolved as ``serve`` does.

Owns :func:`resolve_target`: the plan (``--plan FILE``, or what ``serve`` plans for this
host with the embedded model: :func:`slmguard.serve.modelcheck.plan_host`), the serve
settings that plan gives (:func:`slmguard.settings.resolve`, the environment's
``SLMGUARD_*`` honoured as serve honours them) and the engine settings they make
(:func:`slmguard.settings.engine_settings`), the model file checked against the plan
(:func:`slmguard.plan.model.model_for_plan`: size and sha256) or the embedded one, the
engine binary (``--llama-server``, else :mod:`slmguard.engines`' choice for this CPU,
with its profile), the binary's backend and the model's context checked as serve checks
them, and the :class:`~slmguard.serve.llamaserver.EngineConfig` serve would start it
with. It starts nothing.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from slmguard import paths, settings
from slmguard.engines import select_engine
from slmguard.errors import ConfigError
from slmguard.host.cpufeatures import read_cpu_features
from slmguard.plan.schema import Plan, dumps_plan, load_plan
from slmguard.serve.llamaserver import (
    EngineConfig,
    check_backend,
    engine_env,
    engine_version,
    find_llama_server,
)
from slmguard.serve.modelcheck import plan_host, probe_model
from slmguard.serve.server import check_context


@dataclass(frozen=True)
class BenchTarget:
    """Everything the run starts and records about what it ran."""

    plan: Plan
    plan_source: str  # the file, or "planned for this host"
    plan_sha256: str  # of the plan as serve reads it (its canonical JSON)
    model_path: Path
    model_sha256: str | None
    model_file_bytes: int
    binary: Path
    version: str  # the binary's --version line
    profile: str  # the build's CPU profile, or where it came from
    cpu_features: tuple[str, ...]
    config: EngineConfig
    env: dict[str, str]  # what serve adds to the engine's environment
    serve: settings.ServeSettings


def plan_digest(plan: Plan) -> str:
    return hashlib.sha256(dumps_plan(plan).encode("utf-8")).hexdigest()


def _binary(explicit: Path | None, plan: Plan) -> tuple[Path, str]:
    """The engine binary and its profile, chosen as serve chooses it: the one given, else
    slmguard's choice for this CPU (a plan may name only that one)."""
    if explicit is not None:
        return find_llama_server(explicit), f"given: {explicit}"
    selection = select_engine()
    chosen = selection.chosen
    if chosen is None:
        binary = find_llama_server(None)  # raises EngineUnavailableError naming where
        return binary, selection.reason
    planned = plan.engine.llama_server
    if planned is not None and not _same(Path(planned), chosen.binary):
        raise ConfigError(
            f"the plan's engine.llama_server {planned} is not the engine slmguard selects "
            f"({chosen.binary}); a plan does not choose the executable to run",
            hint=f"to run it, pass --llama-server {planned}",
        )
    profile = chosen.info.profile if chosen.info is not None else chosen.source
    return chosen.binary, profile


def _same(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def _model(plan: Plan | None, state_dir: Path) -> tuple[Path, str | None]:
    """The planned model, checked (a file plan); else the embedded one, verified."""
    if plan is not None:
        from slmguard.plan.model import model_for_plan

        spec = model_for_plan(plan, None, state_dir=state_dir)
        return Path(str(spec.path)), spec.sha256
    from slmguard.default_model import ensure_default_model, stamped_digest

    model = ensure_default_model(paths.model_dir())
    return model, stamped_digest(model)


def resolve_target(
    plan_file: Path | None, llama_server: Path | None, state_dir: Path | None = None
) -> BenchTarget:
    """The target of ``slmguard bench [--plan FILE] [--llama-server PATH]``."""
    state = state_dir or paths.state_dir()
    if plan_file is not None:
        plan = load_plan(plan_file)
        source = str(plan_file)
        model, sha256 = _model(plan, state)
    else:
        plan = plan_host(None, state_dir=state).plan
        source = "planned for this host (the embedded model, as serve plans it)"
        model, sha256 = _model(None, state)
    s = settings.resolve(None, env=os.environ, plan=plan)
    engine = settings.engine_settings(s, plan)
    binary, profile = _binary(llama_server or s.llama_server, plan)
    check_backend(binary, engine)
    facts = probe_model(model)
    config = EngineConfig.of(
        engine, model_path=str(model.resolve()), pooling_type=facts.pooling_type
    )
    check_context(config, facts)
    cpu = read_cpu_features()
    return BenchTarget(
        plan=plan,
        plan_source=source,
        plan_sha256=plan_digest(plan),
        model_path=model,
        model_sha256=sha256,
        model_file_bytes=facts.file_bytes,
        binary=binary,
        version=engine_version(binary),
        profile=profile,
        cpu_features=tuple(sorted(cpu.features)),
        config=config,
        env=engine_env(config, state),
        serve=s,
    )

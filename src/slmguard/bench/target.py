"""What the bench measures: a plan, its model and the engine, resolved as ``serve`` does.

Owns :func:`resolve_target`: the plan (``--plan FILE``, or what ``serve`` plans for this
host with the embedded model), the serve settings that plan gives
(:func:`slmguard.settings.resolve`, the environment's ``SLMGUARD_*`` honoured as serve
honours them), then serve's own start, :func:`slmguard.serve.startup.prepare`: the engine
settings, the binary, the model checked against the plan (size and sha256), the context,
the backend and the budget checked, and the
:class:`~slmguard.serve.llamaserver.EngineConfig` serve starts the engine with. Adds what
a record names beyond it: the build's CPU profile, the CPU's features, the engine's
environment. It starts nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from slmguard import paths, settings
from slmguard.engines import select_engine
from slmguard.host.cpufeatures import read_cpu_features
from slmguard.plan.planfile import dumps_plan, load_plan
from slmguard.plan.schema import Plan
from slmguard.serve.llamaserver import EngineConfig, engine_env
from slmguard.serve.startup import prepare


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


def _profile(given: Path | None, binary: Path) -> str:
    """The build's CPU profile, or where the binary came from."""
    if given is not None:
        return f"given: {given}"
    selection = select_engine()
    chosen = selection.chosen
    if chosen is None or not _same(chosen.binary, binary):
        return selection.reason
    return chosen.info.profile if chosen.info is not None else chosen.source


def _same(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def resolve_target(
    plan_file: Path | None, llama_server: Path | None, state_dir: Path | None = None
) -> BenchTarget:
    """The target of ``slmguard bench [--plan FILE] [--llama-server PATH]``."""
    state = state_dir or paths.state_dir()
    plan = load_plan(plan_file) if plan_file is not None else None
    s = settings.resolve(None, env=os.environ, plan=plan)
    s = dataclasses.replace(s, state_dir=state, llama_server=llama_server or s.llama_server)
    start = prepare(s, plan)  # None: serve's plan for this host
    cpu = read_cpu_features()
    return BenchTarget(
        plan=start.checked,
        plan_source=str(plan_file)
        if plan_file is not None
        else ("planned for this host (the embedded model, as serve plans it)"),
        plan_sha256=plan_digest(plan if plan is not None else start.checked),
        model_path=start.model_path,
        model_sha256=start.sha256,
        model_file_bytes=start.facts.file_bytes,
        binary=start.binary,
        version=start.version,
        profile=_profile(s.llama_server, start.binary),
        cpu_features=tuple(sorted(cpu.features)),
        config=start.engine,
        env=engine_env(start.engine, state),
        serve=s,
    )

"""How long the server may take to start and to stop on a board, from the plan.

Owns the two time budgets the fleet renderers hand to an orchestrator: the start-up
allowance (Kubernetes' ``startupProbe``, the engine's load timeout in the pod, the
Ansible role's wait for ``/health``) and the stop allowance
(``terminationGracePeriodSeconds``). The start is ``FRONT_START_S + 2 * file_bytes /
STORAGE_BYTES_PER_S + ENGINE_WARMUP_S`` (the model is read twice: the sha256 check, then
the load), times :data:`ALLOWANCE_FACTOR`. The storage rate is a slow SD card's (a Pi's
read 40-90 MB/s; worn ones less): too short an allowance restarts a healthy pod forever,
too long only delays noticing a broken one. The stop is the drain
(``shutdown_grace_s``), the engine's stop and the interpreter's exit. A new pod counts
only once ready for :data:`MIN_READY_S`, twice the liveness window (3 x 10 s), so a pod
that passes its first probes and then dies stops the rollout. ``docs/fleet.md``
tabulates the figures.

Pure arithmetic on the plan: it must not read the host, render YAML or probe anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slmguard.plan.schema import Plan
from slmguard.settings import ServeSettings

#: The front's start on a board: measured 3-5 s on this project's 2-core x86 host
#: (45-75 s under the system test's 14x-slower emulation), boards' cores are 2-3x
#: slower than the host's, doubled again for a busy board.
FRONT_START_S = 30
#: Sequential read rate assumed for the model file (bytes per second; see above).
STORAGE_BYTES_PER_S = 25 * 10**6
#: llama-server's warm-up decode and its KV/compute allocations after the weights.
ENGINE_WARMUP_S = 10
#: Allowance = this times the estimate.
ALLOWANCE_FACTOR = 2
#: The server's drain time (``serve --shutdown-grace-s``), its declared default.
SHUTDOWN_GRACE_S = int(ServeSettings.shutdown_grace_s)
#: How long the front waits for its engine to exit (``EngineProcess.stop``'s timeout).
ENGINE_STOP_S = 10
#: The interpreter's exit after the engine is gone.
STOP_MARGIN_S = 5
#: Seconds a new pod must stay ready before the next is touched (see the module docstring).
MIN_READY_S = 60
#: The server's own engine-load timeout default (``serve --engine-load-timeout-s``).
ENGINE_LOAD_TIMEOUT_S = int(ServeSettings.engine_load_timeout_s)


@dataclass(frozen=True)
class Timing:
    """The time budgets of one plan, in whole seconds, with how they were reached."""

    load_estimate_s: int
    startup_allowance_s: int
    engine_load_timeout_s: int  # what the server is told (never below its own default)
    stop_grace_s: int
    why_startup: str
    why_stop: str
    min_ready_s: int = MIN_READY_S
    why_min_ready: str = (
        f"available once ready for {MIN_READY_S} s: twice the liveness window (3 x 10 s), so "
        "a pod that dies or hangs after its first answers stops the rollout"
    )


def timing(plan: Plan) -> Timing:
    """The start-up and stop budgets for ``plan`` (see the module docstring)."""
    file_bytes = plan.model.file_bytes
    read_s = math.ceil(2 * file_bytes / STORAGE_BYTES_PER_S)
    estimate = FRONT_START_S + read_s + ENGINE_WARMUP_S
    allowance = ALLOWANCE_FACTOR * estimate
    stop = SHUTDOWN_GRACE_S + ENGINE_STOP_S + STOP_MARGIN_S
    mb = file_bytes / 10**6
    return Timing(
        load_estimate_s=estimate,
        startup_allowance_s=allowance,
        engine_load_timeout_s=max(ENGINE_LOAD_TIMEOUT_S, allowance),
        stop_grace_s=stop,
        why_startup=(
            f"start-up allowance {allowance} s = {ALLOWANCE_FACTOR} x (front start "
            f"{FRONT_START_S} s + the {mb:.0f} MB model read twice at "
            f"{STORAGE_BYTES_PER_S // 10**6} MB/s, sha256 check then load, {read_s} s + "
            f"engine warm-up {ENGINE_WARMUP_S} s)"
        ),
        why_stop=(
            f"stop allowance {stop} s = drain {SHUTDOWN_GRACE_S} s + engine stop "
            f"{ENGINE_STOP_S} s + exit {STOP_MARGIN_S} s"
        ),
    )

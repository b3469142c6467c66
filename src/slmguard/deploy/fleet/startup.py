"""How long the server may take to start and to stop on a board, from the plan.

Owns the two time budgets the fleet renderers hand to an orchestrator: the
start-up allowance (Kubernetes' ``startupProbe``, the engine's load timeout in
the pod, how long the Ansible role waits for ``/health`` to answer 200) and the
stop allowance (``terminationGracePeriodSeconds``). Pure arithmetic on the
plan; every figure is a named constant with the reason it has its value.

The start, on the board, is three things one after the other:

1. the front starts: Python imports, the settings and the plan, the engine
   child spawned (:data:`FRONT_START_S`);
2. ``serve --plan`` checks the model file against the plan, size and sha256
   (one full read of the file), before it starts the engine;
3. llama-server maps the file and, on a CPU build, repacks the weights (a
   second full read when the first did not stay in the page cache), then
   warms up with one decode (:data:`ENGINE_WARMUP_S`).

So the estimate is ``FRONT_START_S + 2 * file_bytes / STORAGE_BYTES_PER_S +
ENGINE_WARMUP_S`` and the allowance is :data:`ALLOWANCE_FACTOR` times it: a
model that has not loaded by then is not loading. The storage rate is the
pessimistic end of the boards' storage (SD cards in a Raspberry Pi read 40-90
MB/s; a worn or cheap one less; eMMC and NVMe are faster), like the governor's
pessimistic fill rate: a too-short allowance restarts a healthy pod forever,
a long one only delays noticing a broken one.

A rolled-out pod counts as available only once it has been ready for
:data:`MIN_READY_S` (the DaemonSets' ``minReadySeconds``): twice the liveness
window (3 x 10 s, the unit's ``WatchdogSec=30``), so a pod that answers its
first probes and then dies or hangs (a slow leak, an engine that stalls on its
first real work) stops the rollout before the next node is touched.

The stop: the front drains in-flight requests for ``shutdown_grace_s`` (the
server's setting, default :data:`SHUTDOWN_GRACE_S`), then stops its engine,
waiting up to :data:`ENGINE_STOP_S` for it, then exits; :data:`STOP_MARGIN_S`
covers the interpreter's own exit. Past the total the kubelet sends SIGKILL.
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

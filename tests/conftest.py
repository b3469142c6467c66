"""Shared fixtures: a real ``slmguard serve`` on a free loopback port.

The server is started the way a user starts it (the ``slmguard`` console
script in a subprocess) with the real engine and the default model, and torn
down reliably (SIGTERM, then SIGKILL of its process group), even when a test
fails or kills the worker. Helpers live in ``tests/serveproc.py``.

- ``serve_factory``: start servers with extra arguments; each stops at teardown.
- ``server``: one shared server for the session (n_ctx 512, queue 2, body limit
  64 KiB, max_tokens capped at 64), for tests that do not disturb it. Tests that
  kill or reconfigure the worker use ``serve_factory``.
- ``rerank_model``, ``embedding_model``: a tiny BERT reranker GGUF and the same
  encoder as an embedding model, written for the session (``tests/rerankmodel.py``):
  the real reranking and embedding models the tests serve.

Tests using these need the ``engine`` marker; they are skipped, with the
reason, when llama-cpp-python is not installed.

Every test also gets a private state directory (``SLMGUARD_STATE_DIR``, unless
the environment already sets one), so no test writes the machine's own
(``/var/lib/slmguard`` as root): digest caches, kmsg cursors, crash bundles.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from serveproc import ServeFactory, ServerProcess, start_server


@pytest.fixture(autouse=True)
def _private_state_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not os.environ.get("SLMGUARD_STATE_DIR"):
        monkeypatch.setenv("SLMGUARD_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture
def serve_factory(tmp_path: Path) -> Iterator[ServeFactory]:
    factory = ServeFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture(scope="session")
def rerank_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rerankmodel import write_reranker

    return write_reranker(tmp_path_factory.mktemp("rerank") / "tiny-bert-reranker.gguf")


@pytest.fixture(scope="session")
def embedding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rerankmodel import write_embedder

    return write_embedder(tmp_path_factory.mktemp("embed") / "tiny-bert-embedder.gguf")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_server(
        tmp_path_factory.mktemp("serve"),
        ["--queue-size", "2", "--max-body-bytes", "65536", "--max-tokens-cap", "64"],
    )
    try:
        yield s
    finally:
        s.stop()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--clients",
        action="store_true",
        help="also run the tests marked clients (the agent frameworks: make test passes it)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``clients`` tests need the clients extra and ``.venv/openai2`` (``make test``
    installs both): deselected unless ``--clients`` asks for them, whatever ``-m`` says."""
    if config.getoption("--clients"):
        return
    skipped = [item for item in items if item.get_closest_marker("clients")]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items if not item.get_closest_marker("clients")]

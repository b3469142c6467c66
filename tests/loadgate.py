"""The held model load (``tests/loadgate.c``), built for a test.

:func:`build` compiles it with the system's C compiler into a shared object;
:func:`engine_env` is the environment that makes llama-server load it and hold its
opening of the model's ``.gguf`` while ``gate`` exists: the engine listens and answers
"Loading model" for as long as the test wants, and loads the model for real once the
test removes the gate. The front is unaffected (the shim acts only in a program named
``llama-server``). Used by ``test_docs_runnable.py`` (Troubleshooting's loading entry).

Example::

    shim = build(tmp_path)                 # None: no C compiler here
    gate = tmp_path / "gate"; gate.touch()
    env = engine_env(shim, gate)           # held until gate.unlink()
    held(gate).exists()                    # True while the engine waits at its model
"""

from __future__ import annotations

from pathlib import Path

from preloadshim import compile_shim

SOURCE = Path(__file__).with_name("loadgate.c")


def build(dest_dir: Path) -> Path | None:
    """``loadgate.so`` in ``dest_dir``; None when there is no C compiler."""
    return compile_shim(SOURCE, dest_dir)


def engine_env(shim: Path, gate: Path, max_wait_s: int = 600) -> dict[str, str]:
    """The engine's extra environment: preload ``shim``, hold the model while ``gate``
    exists (``max_wait_s`` at most, so that a dead test never leaves an engine held)."""
    return {"LD_PRELOAD": str(shim), "LOADGATE_FILE": str(gate), "LOADGATE_MAX_S": str(max_wait_s)}


def held(gate: Path) -> Path:
    """The file that exists while the engine waits at the gate."""
    return gate.with_name(gate.name + ".held")

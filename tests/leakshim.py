"""The preloaded leak (``tests/leakshim.c``), built for a test or a benchmark.

:func:`build` compiles it with the system's C compiler into a shared object;
:func:`engine_env` is the environment that makes llama-server load it and leak that
many bytes of written heap per generation request it reads. The front is unaffected
(the shim acts only in a program named ``llama-server``). Used by
``test_serve_recycle.py`` and ``benchmarks/recycle.py``.

Example::

    shim = build(tmp_path)            # None: no C compiler here
    env = engine_env(shim, 4 << 20)   # 4 MiB per request
"""

from __future__ import annotations

from pathlib import Path

from preloadshim import compile_shim

SOURCE = Path(__file__).with_name("leakshim.c")


def build(dest_dir: Path) -> Path | None:
    """``leakshim.so`` in ``dest_dir``; None when there is no C compiler."""
    return compile_shim(SOURCE, dest_dir)


def engine_env(shim: Path, leak_bytes: int) -> dict[str, str]:
    """The engine's extra environment: preload ``shim``, leak ``leak_bytes`` a request."""
    return {"LD_PRELOAD": str(shim), "LEAKSHIM_BYTES": str(leak_bytes)}

"""Compiling an LD_PRELOAD shim of the tests (``leakshim.c``, ``loadgate.c``), once.

:func:`compile_shim` builds a C source beside this file into ``NAME.so`` with the
system's C compiler (warnings are errors), or says there is none (None). What each shim
does and the environment that loads it stay in its own module (``leakshim.py``,
``loadgate.py``); this module only compiles.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def compile_shim(source: Path, dest_dir: Path) -> Path | None:
    """``<source stem>.so`` in ``dest_dir``; None when there is no C compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = dest_dir / f"{source.stem}.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(out),
         str(source), "-ldl"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return out

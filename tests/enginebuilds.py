"""The package's x86-64 engine build as the package builder describes it.

``AVX2_FLAGS`` are the cmake flags of the ``avx2`` build (the Makefile's
``LLAMA_CMAKE_ARGS``), ``avx2_info()`` its build.json (``packaging/debcontrol.py``
derives the CPU features from the flags), for the engine-selection and
``slmguard engine`` tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

from slmguard.engines import BuildInfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packaging"))
import debcontrol

AVX2_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
)


def avx2_info(features: tuple[str, ...] | None = None) -> BuildInfo:
    """The avx2 build's description; ``features`` replaces the ones its flags give."""
    if features is None:
        features = debcontrol.x86_features(AVX2_FLAGS)
    return BuildInfo("avx2", "x86_64", features, "0c1e570", ("cpu",), AVX2_FLAGS)

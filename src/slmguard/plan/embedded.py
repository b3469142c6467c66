"""The embedded model's header facts, recorded: what a base install plans.

The embedded default model (Gemma 3 270M base, Q4_K_M) comes in the ``serve``
extra's model package. Where that package is not installed (a base install:
``plan``, ``doctor`` and ``render`` on a board), ``plan`` with no ``--model``
plans the same file from its header facts recorded here
(``slmguard/data/embedded-model.json``: every field :func:`read_model_facts`
gives, the tensor table included, its file name and sha256), so a base and a
full install make the same plan for the same file. It reads no host file and
must not import the model package; ``tests/test_plan_embedded.py`` checks the
record against the real file (rewrite it with ``python -m slmguard.plan.embedded
FILE``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from slmguard.plan.ggufheader import TensorFacts
from slmguard.plan.modelfacts import ModelFacts

RECORD = "embedded-model.json"


@dataclasses.dataclass(frozen=True)
class Recorded:
    """The embedded model as recorded: its facts (``path`` is its file name), its
    file name in the model directory and its sha256."""

    facts: ModelFacts
    file_name: str
    sha256: str


def as_json(facts: ModelFacts, sha256: str) -> str:
    """The record of a model file's facts (one JSON document)."""
    data = dataclasses.asdict(facts)
    data["path"] = facts.path.name
    data["tensors"] = [dataclasses.astuple(t) for t in facts.tensors]
    return json.dumps({"sha256": sha256, "facts": data}, indent=0, sort_keys=True) + "\n"


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def from_json(text: str) -> Recorded:
    """A record read back (ValueError for one that is not a record)."""
    doc = json.loads(text)
    data = dict(doc["facts"])
    name = str(data["path"])
    data["path"] = Path(name)
    for key in ("n_head", "n_head_kv", "swa_layers"):
        data[key] = _tuple(data[key])
    data["tensors"] = tuple(
        TensorFacts(n, t, tuple(shape), off, size) for n, t, shape, off, size in data["tensors"]
    )
    return Recorded(ModelFacts(**data), name, str(doc["sha256"]))


def recorded() -> Recorded:
    """The embedded model's record, as shipped in the package."""
    return from_json((resources.files("slmguard") / "data" / RECORD).read_text())


def main(argv: list[str]) -> int:
    """``python -m slmguard.plan.embedded FILE``: write the record of FILE (the embedded
    model, as ``make model`` assembles it) into the package's data."""
    from slmguard.default_model import sha256_file
    from slmguard.plan.modelfacts import read_model_facts

    path = Path(argv[0])
    out = Path(str(resources.files("slmguard"))) / "data" / RECORD
    out.write_text(as_json(read_model_facts(path), sha256_file(path)))
    print(out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))

"""A board plan whose every file exists, for the fleet renderers' tests (issues 39, 42).

``files_plan(dir)``: ``rendertrees.make_plan``'s board with its primary model, a
reranker beside it (``boardplans.board_plan``'s, on demand) and a vision projector,
each a stand-in GGUF written under ``dir`` (size and sha256 are what a deployment
checks), loaded back through the plan loader so its relations hold.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from boardplans import board_plan
from rendertrees import make_model_file, make_plan
from slmguard.plan.planfile import dumps_plan, load_plan
from slmguard.plan.schema import Plan, ProjectorSpec


def files_plan(d: Path, rerank_name: str = "rerank.gguf") -> tuple[Path, Plan]:
    """(the plan file, the plan): a model, a board model and a projector, all on disk."""
    model, size, digest = make_model_file(d / "m.gguf")
    rerank, rsize, rdigest = make_model_file(d / rerank_name, 32 << 10)
    mmproj, vsize, vdigest = make_model_file(d / "mmproj-tiny.gguf", 8 << 10)
    plan = make_plan(model_path=str(model), model_bytes=size, model_sha256=digest)
    board = board_plan()
    assert board.serving is not None
    (encoder,) = board.models
    encoder = dataclasses.replace(
        encoder,
        model=dataclasses.replace(
            encoder.model, path=str(rerank), file_bytes=rsize, sha256=rdigest
        ),
    )
    projector = ProjectorSpec(
        path=str(mmproj), file_bytes=vsize, name="tiny", projector_type="gemma3",
        tokens_per_image=16, sha256=vdigest, max_images=3,
    )  # fmt: skip
    plan = dataclasses.replace(
        plan,
        engine=dataclasses.replace(plan.engine, n_batch=512, n_ubatch=512),
        serving=dataclasses.replace(board.serving, name=plan.model.name),
        models=(encoder,),
        resident_sets=tuple(
            dataclasses.replace(r, models=(plan.model.name, "rerank")) for r in board.resident_sets
        ),
        projector=projector,
    )
    path = d / "plan.json"
    path.write_text(dumps_plan(plan))
    return path, load_plan(path)

"""Plans with the board's fields for the tests (issue 39): ``primary_plan()``, a one-model
plan, and ``board_plan()``: the same primary with an on-demand reranker beside it, two
neighbours and the one resident set of both."""

from __future__ import annotations

import dataclasses

from slmguard.plan.schema import (
    BoardModel,
    BoardSpec,
    BudgetPart,
    EngineSettings,
    Limits,
    ModelSpec,
    Neighbour,
    Plan,
    ResidentSet,
    Serving,
)


def primary_plan() -> Plan:
    return Plan(
        model=ModelSpec(
            name="gemma", arch="gemma3", file_bytes=253_000_000, n_layer=18,
            n_ctx_train=32768, path="/m/gemma.gguf", sha256="0" * 64,
        ),
        board=BoardSpec(name="rk3588-4g", ram_bytes=4 << 30, cpus=(0, 1, 2, 3), big_cores=()),
        engine=EngineSettings(n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=4),
        limits=Limits(
            memory_high_bytes=2 << 30, memory_max_bytes=2200 << 20, os_reserve_bytes=512 << 20,
            business_reserve_bytes=1 << 30,
        ),
        budget=(BudgetPart("kv_cache", 37_748_736),),
    )  # fmt: skip


def board_plan() -> Plan:
    encoder = BoardModel(
        serving=Serving(
            name="rerank", aliases=("bge-reranker",), role="rerank", residency="on_demand",
            priority=10, idle_unload_s=300,
        ),
        model=ModelSpec(
            name="tiny rerank", arch="bert", file_bytes=1_000_000, n_layer=2, n_ctx_train=512,
            path="/m/rerank.gguf", sha256="1" * 64,
        ),
        engine=EngineSettings(n_ctx=512, n_batch=512, n_ubatch=512, n_threads=4),
        budget=(BudgetPart("weights_mapped", 1_000_000, kind="file"),),
        reasons={"n_ctx": "the trained context"},
    )  # fmt: skip
    return dataclasses.replace(
        primary_plan(),
        serving=Serving(name="gemma", aliases=("chat",)),
        models=(encoder,),
        neighbours=(
            Neighbour("whisper", 600 << 20, unit="whisper.service"),
            Neighbour("camera", 200 << 20, protection="low", source="memory_peak"),
        ),
        resident_sets=(ResidentSet(("gemma", "rerank"), 900 << 20),),
    )

"""Budget arithmetic against hand-computed cases and the engine's own log numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from slmguard.plan.budget import (
    FRONT_ANON_BYTES,
    THREAD_STACK_BYTES,
    WORKER_ANON_PER_TOKEN_BYTES,
    WORKER_BASE_ANON_BYTES,
    WORKER_BASE_COMMIT_BYTES,
    WORKER_COMMIT_PER_TOKEN_BYTES,
    BudgetInput,
    compute_budget,
    compute_reserved_bytes,
    kv_cache_bytes,
    kv_type_bytes,
    repacked_bytes,
    swa_cells,
)
from slmguard.plan.modelfacts import ModelFacts, TensorFacts, read_model_facts

MiB = 1 << 20


@pytest.fixture(scope="module")
def gemma() -> ModelFacts:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    return read_model_facts(ensure_default_model(paths.model_dir()))


def _tiny(**kw: object) -> ModelFacts:
    base: dict[str, object] = dict(
        path=Path("t.gguf"),
        arch="llama",
        name="t",
        n_layer=2,
        n_head=4,
        n_head_kv=2,
        key_length=64,
        value_length=64,
        n_embd=256,
        n_vocab=1000,
        n_ctx_train=4096,
        sliding_window=0,
        swa_layers=(),
        chat_template=None,
        file_bytes=10_000,
        tensor_bytes_by_type={"Q4_K": 9000},
        n_ff=512,
        data_offset_bytes=1000,
        tensors=(
            TensorFacts("token_embd.weight", "Q4_K", (256, 1000), 0, 4000),
            TensorFacts("blk.0.ffn_up.weight", "Q4_K", (256, 512), 4000, 3000),
            TensorFacts("blk.0.attn_k.weight", "Q4_K", (256, 12), 7000, 1000),  # 12 % 8 != 0
            TensorFacts("blk.0.attn_q.weight", "Q8_0", (256, 256), 8000, 1000),
        ),
    )
    base.update(kw)
    return ModelFacts(**base)  # type: ignore[arg-type]


def test_kv_cache_hand_computed(gemma: ModelFacts) -> None:
    # 18 layers x 1 KV head x (256 + 256) x 2 bytes = 18,432 bytes per cell.
    assert kv_cache_bytes(gemma, 2048) == 2048 * 18 * 512 * 2 == 37_748_736
    # The engine logs 6.00 MiB (3 full layers) + 30.00 MiB (15 SWA layers, full size).
    assert kv_cache_bytes(gemma, 2048) == 36 * MiB
    # q8_0: 34 bytes per 32 values.
    assert kv_cache_bytes(gemma, 2048, "q8_0") == 2048 * 18 * 512 // 32 * 34
    # Small SWA cache: min(n_ctx, pad256(512 + n_ubatch)) cells on the 15 SWA layers;
    # the engine logs 11.25 MiB at n_ubatch 64 (768 cells) and 15.00 MiB at 512.
    assert swa_cells(gemma, 8192, 64, swa_full=False) == 768
    assert swa_cells(gemma, 8192, 512, swa_full=False) == 1024
    assert swa_cells(gemma, 512, 512, swa_full=False) == 512
    small = kv_cache_bytes(gemma, 8192, n_ubatch=64, swa_full=False)
    assert small == 3 * 8192 * 1024 + 15 * 768 * 1024 == 24 * MiB + 11.25 * MiB


def test_kv_per_layer_heads() -> None:
    f = _tiny(n_head_kv=(1, 4))
    assert kv_cache_bytes(f, 100) == 100 * (1 + 4) * 128 * 2


def test_kv_type_errors() -> None:
    with pytest.raises(ValueError, match="unknown KV type"):
        kv_type_bytes("f32", 64)
    with pytest.raises(ValueError, match="whole blocks"):
        kv_type_bytes("q8_0", 33)


def test_compute_reserved_matches_engine_log(gemma: ModelFacts) -> None:
    # llama.cpp reports 514.50 MiB at n_ubatch 512 and 64.31 MiB at 64 (n_ctx 2048).
    assert compute_reserved_bytes(gemma, 2048, 512, flash_attn=False) == 539_492_352
    assert compute_reserved_bytes(gemma, 2048, 512, False) / MiB == 514.5
    assert round(compute_reserved_bytes(gemma, 2048, 64, False) / MiB, 2) == 64.31
    # A small vocabulary at a long context: the attention scores dominate.
    f = _tiny()
    assert compute_reserved_bytes(f, 4096, 512, False) == 2 * 512 * 4096 * 4 * 4
    assert compute_reserved_bytes(f, 4096, 512, True) == 512 * (1000 + 512) * 4


def test_repack_rules(gemma: ModelFacts) -> None:
    # The engine logs "CPU_REPACK model buffer size = 12.66 MiB": the Q4_K tensors.
    assert repacked_bytes(gemma, "x86_avx2") == gemma.tensor_bytes_by_type["Q4_K"] == 13_271_040
    assert repacked_bytes(gemma, "none") == 0
    # token_embd never, rows not divisible by 8 never, Q8_0 not on AVX2.
    assert repacked_bytes(_tiny(), "x86_avx2") == 3000


def test_budget_parts_and_totals(gemma: ModelFacts) -> None:
    b = compute_budget(BudgetInput(gemma, n_ctx=2048, n_batch=512, n_threads=2))
    names = [p.name for p in b.parts]
    assert names[:2] == ["weights_mapped", "weights_mapped_cold"]
    part = {p.name: p for p in b.parts}
    assert part["kv_cache"].bytes == 36 * MiB and part["kv_cache"].when == "load"
    assert part["compute_buffer"].when == "use" and part["compute_buffer"].kind == "anon"
    assert part["weights_mapped"].kind == "file"
    mapped = gemma.file_bytes - gemma.data_offset_bytes
    assert part["weights_mapped"].bytes + part["weights_mapped_cold"].bytes == mapped
    assert part["output_buffer"].bytes == 262_144 * 4
    runtime = WORKER_BASE_ANON_BYTES + WORKER_ANON_PER_TOKEN_BYTES * 262_144
    assert part["worker_runtime"].bytes == runtime
    assert part["front_runtime"].bytes == FRONT_ANON_BYTES
    assert b.engine_anon_peak_bytes == sum(
        part[n].bytes
        for n in (
            "weights_repacked",
            "kv_cache",
            "output_buffer",
            "compute_buffer",
            "worker_runtime",
        )
    )
    # Commit: every reservation in full, the logits array, the thread stacks.
    assert b.engine_commit_bytes == (
        WORKER_BASE_COMMIT_BYTES
        + WORKER_COMMIT_PER_TOKEN_BYTES * 262_144
        + 36 * MiB
        + 13_271_040
        + 262_144 * 4
        + 539_492_352
        + 512 * 262_144 * 4
        + 2 * THREAD_STACK_BYTES
    )
    assert b.service_hot_bytes == b.service_bytes - part["weights_mapped_cold"].bytes


def test_resident_compute_never_exceeds_reservation(gemma: ModelFacts) -> None:
    for n_ctx in (512, 8192, 32768):
        b = compute_budget(BudgetInput(gemma, n_ctx=n_ctx, n_batch=512))
        cb = b.part("compute_buffer")
        assert cb is not None and cb.bytes <= b.compute_reserved_bytes


def test_reserves_become_parts(gemma: ModelFacts) -> None:
    b = compute_budget(
        BudgetInput(
            gemma,
            n_ctx=512,
            npu_reserve_bytes=256 * MiB,
            os_reserve_bytes=512 * MiB,
            business_reserve_bytes=128 * MiB,
            front_process=False,
        )
    )
    assert b.reserve_bytes == (256 + 512 + 128) * MiB
    assert b.part("front_runtime") is None and b.front_commit_bytes == 0
    with pytest.raises(ValueError, match="must be > 0"):
        compute_budget(BudgetInput(gemma, n_ctx=0))

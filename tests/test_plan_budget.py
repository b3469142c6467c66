"""Budget arithmetic against hand-computed cases and the engine's own recorded reports.

``fixtures/engine/llama_server_buffers.json`` holds 618 load reports of the real
llama-server (what it printed and its /proc numbers right after load; the
file's ``source`` says how they were taken): the embedded Gemma 3 270M and
zero-weight GGUFs with five presets' exact shapes, over n_ctx 512..32768 x
n_ubatch 64..512 x slots 1/4 x unified or per-slot KV x full or small SWA
cache x f16/q8_0 KV x flash attention on/off.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planinputs import board, budget_input
from slmguard.plan.allocation import (
    FRONT_ANON_BYTES,
    SERVER_BASE_ANON_BYTES,
    SERVER_FILE_BYTES,
    THREAD_STACK_BYTES,
    compute_phases,
    compute_reserved_bytes,
    engine_cells,
    http_threads,
    kv_cache_bytes,
    kv_type_bytes,
    mapped_bytes,
    repacked_bytes,
    repacked_split,
    swa_cells,
)
from slmguard.plan.budget import compute_budget
from slmguard.plan.modelfacts import ModelFacts, TensorFacts, read_model_facts
from slmguard.plan.parts import BudgetInput
from slmguard.plan.presets import preset_facts

MiB = 1 << 20
FIXTURES = Path(__file__).parent / "fixtures" / "engine"
LOG_ROUND = 0.006 * MiB  # the engine prints MiB with two decimals


@pytest.fixture(scope="module")
def gemma() -> ModelFacts:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    return read_model_facts(ensure_default_model(paths.model_dir()))


def _recorded() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "llama_server_buffers.json").read_text())
    return data


def _rows(gemma: ModelFacts) -> Iterator[tuple[ModelFacts, dict[str, Any]]]:
    facts: dict[str, ModelFacts] = {}
    for row in _recorded()["rows"]:
        name = row["model"]
        if name not in facts:
            facts[name] = gemma if name.endswith(".gguf") else preset_facts(name[7:])[0]
        yield facts[name], row


def _input(f: ModelFacts, cfg: dict[str, Any], **kw: Any) -> BudgetInput:
    return budget_input(
        f,
        n_ctx=cfg["n_ctx"],
        n_batch=cfg["n_ubatch"],
        n_ubatch=cfg["n_ubatch"],
        n_threads=2,
        n_parallel=cfg["n_parallel"],
        kv_unified=cfg["kv_unified"],
        kv_type=cfg["kv_type"],
        flash_attn=cfg["flash_attn"],
        swa_full=cfg["swa_full"],
        board=board(2),
        front_process=False,
        **kw,
    )


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


def test_recorded_fixture_says_where_it_came_from() -> None:
    data = _recorded()
    assert "0c1e570" in data["source"] and "engine_argv" in data["source"]
    assert len(data["rows"]) == 618


def test_cells_kv_and_output_match_every_recorded_load(gemma: ModelFacts) -> None:
    for f, row in _rows(gemma):
        cfg, log = row["cfg"], row["log"]
        cells = engine_cells(cfg["n_ctx"], cfg["n_parallel"], cfg["kv_unified"])
        assert (cells.n_ctx, cells.n_ctx_slot) == (log["n_ctx"], log["n_ctx_seq"]), row
        kv = kv_cache_bytes(
            f, cells, cfg["kv_type"], n_ubatch=cfg["n_ubatch"], swa_full=cfg["swa_full"]
        )
        assert abs(kv - log["kv_mib"] * MiB) <= 2 * LOG_ROUND, row
        # Each KV cache's cells per stream, as llama_kv_cache logs them (base, then SWA).
        expect = []
        if len(f.swa_layers) < f.n_layer:
            expect.append(cells.stream_cells)
        if f.swa_layers:
            expect.append(swa_cells(f, cells, cfg["n_ubatch"], cfg["swa_full"]))
        assert [c[0] for c in log["kv_caches"]] == expect, row
        b = compute_budget(_input(f, cfg))
        out = b.part("output_buffer")
        assert out is not None and abs(out.bytes - log["output_mib"] * MiB) <= LOG_ROUND, row
        assert log["http_threads"] == http_threads(cfg["n_parallel"], 2)


def test_compute_reservation_against_every_recorded_load(gemma: ModelFacts) -> None:
    """Within -4.1 / +7 MiB everywhere; exact where the rule is structural."""
    for f, row in _rows(gemma):
        cfg, log = row["cfg"], row["log"]
        cells = engine_cells(cfg["n_ctx"], cfg["n_parallel"], cfg["kv_unified"])
        phases = compute_phases(
            f,
            cells,
            cfg["n_ubatch"],
            cfg["flash_attn"],
            swa_full=cfg["swa_full"],
            kv_type=cfg["kv_type"],
        )
        err = phases.total - log["compute_mib"] * MiB
        assert -4.1 * MiB <= err <= 7 * MiB, (row, err / MiB)
        if cfg["flash_attn"] and cfg["kv_type"] == "f16":
            assert abs(err) <= 0.12 * MiB, (row, err / MiB)  # flash attention, f16: exact
        if not cfg["flash_attn"] and phases.attention == phases.total:
            assert abs(err) <= 0.3 * MiB, (row, err / MiB)  # the scores dominate: exact


def test_runtime_and_commit_at_load_against_recorded_loads(gemma: ModelFacts) -> None:
    for f, row in _rows(gemma):
        cfg, log, loaded = row["cfg"], row["log"], row["loaded"]
        buffers = (log["kv_mib"] + log["repack_mib"] + log["output_mib"]) * MiB
        # The server's own heap after load: 43 to 55 MiB on the six shapes.
        assert abs(loaded["RssAnon"] - buffers - SERVER_BASE_ANON_BYTES) <= 7.5 * MiB, row
        assert loaded["Threads"] in (11, 12, 13, 14)
        if not cfg["swa_full"]:
            continue  # checkpoints are budgeted in full but only made while serving
        b = compute_budget(_input(f, cfg))
        use = compute_phases(
            f, b.cells, cfg["n_ubatch"], cfg["flash_attn"], kv_type=cfg["kv_type"]
        ).work
        slot = b.part("slot_state")
        assert slot is not None
        at_load = b.engine_commit_bytes - use - slot.bytes
        # (Presets' tensor sizes are scaled to the published file: 1% slack on top.)
        assert -6 * MiB <= at_load - loaded["commit"] <= 13 * MiB + loaded["commit"] // 100, row


def test_engine_load_logs_parse_and_match_the_rules(gemma: ModelFacts) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from engine_probe import parse_engine_log

    log = parse_engine_log((FIXTURES / "gemma3-270m_c16384_np4_ub512_noswafull_fa.log").read_text())
    assert (log["n_ctx"], log["n_ctx_seq"], log["n_seq_max"]) == (16384, 4096, 4)
    assert log["kv_caches"] == [[4096, 3, 4], [1024, 15, 4]]  # pad256(512 + 512) SWA cells
    cells = engine_cells(16384, 4)
    assert swa_cells(gemma, cells, 512, swa_full=False) == 1024
    kv = kv_cache_bytes(gemma, cells, "f16", n_ubatch=512, swa_full=False)
    assert kv == (48 + 60) * MiB and log["kv_mib"] == 108.0
    reserved = compute_reserved_bytes(gemma, cells, 512, True, swa_full=False)
    assert abs(reserved / MiB - log["compute_mib"]) < 0.1  # 22.77 MiB
    assert log["repack_mib"] == round(repacked_bytes(gemma, "x86_avx2") / MiB, 2) == 12.66
    assert log["http_threads"] == 8

    qwen, _, _ = preset_facts("qwen2.5-0.5b-instruct")
    log = parse_engine_log((FIXTURES / "qwen2.5-0.5b-shape_c8192_np1_ub512_nofa.log").read_text())
    cells = engine_cells(8192)
    assert log["kv_mib"] == kv_cache_bytes(qwen, cells, "f16") / MiB == 96.0
    # The scores of one ubatch: 8192 cells x 512 tokens x 14 heads x 4 B = 224 MiB of 249.26.
    phases = compute_phases(qwen, cells, 512, False)
    assert phases.scores == 224 * MiB
    assert abs(phases.total / MiB - log["compute_mib"]) < 0.1


def test_cells_padding() -> None:
    assert engine_cells(2000).n_ctx == 2048
    c = engine_cells(512, 4)  # 128 per slot, padded to 256: the engine ends up with 1024
    assert (c.n_ctx, c.n_ctx_slot, c.n_stream) == (1024, 256, 4)
    u = engine_cells(8192, 4, kv_unified=True)
    assert (u.n_ctx, u.n_ctx_slot, u.n_stream, u.stream_cells) == (8192, 8192, 1, 8192)
    with pytest.raises(ValueError, match="must be > 0"):
        engine_cells(0)


def test_kv_cache_hand_computed(gemma: ModelFacts) -> None:
    # 18 layers x 1 KV head x (256 + 256) x 2 bytes = 18,432 bytes per cell.
    assert kv_cache_bytes(gemma, engine_cells(2048)) == 2048 * 18 * 512 * 2 == 36 * MiB
    assert kv_cache_bytes(gemma, engine_cells(2048), "q8_0") == 2048 * 18 * 512 // 32 * 34
    # Small SWA cache: pad256(min(cells, 512 + n_ubatch)) on the 15 SWA layers.
    assert swa_cells(gemma, engine_cells(8192), 64, swa_full=False) == 768
    assert swa_cells(gemma, engine_cells(512), 512, swa_full=False) == 512
    # Unified: the window counts once per slot.
    assert swa_cells(gemma, engine_cells(8192, 4, True), 64, swa_full=False) == 2304
    small = kv_cache_bytes(gemma, engine_cells(8192), n_ubatch=64, swa_full=False)
    assert small == 3 * 8192 * 1024 + 15 * 768 * 1024


def test_kv_per_layer_heads_and_type_errors() -> None:
    f = _tiny(n_head_kv=(1, 4))
    assert kv_cache_bytes(f, engine_cells(256)) == 256 * (1 + 4) * 128 * 2
    with pytest.raises(ValueError, match="unknown KV type"):
        kv_type_bytes("f32", 64)
    with pytest.raises(ValueError, match="whole blocks"):
        kv_type_bytes("q8_0", 33)


def test_repack_rules(gemma: ModelFacts) -> None:
    # The engine logs "CPU_REPACK model buffer size = 12.66 MiB": the Q4_K tensors.
    assert repacked_bytes(gemma, "x86_avx2") == gemma.tensor_bytes_by_type["Q4_K"] == 13_271_040
    assert repacked_bytes(gemma, "none") == 0
    # With tied embeddings the output matmul's copy of token_embd is repacked
    # (its file pages stay hot: get_rows reads them); rows not divisible by 8
    # never; Q8_0 not on AVX2.
    assert repacked_split(_tiny(), "x86_avx2") == (3000 + 4000, 4000)
    untied = _tiny(
        tensors=(*_tiny().tensors, TensorFacts("output.weight", "Q6_K", (256, 1000), 9000, 500))
    )
    assert repacked_split(untied, "x86_avx2") == (3000, 0)  # no Q6_K kernel on AVX2
    # ARM dotprod also repacks Q8_0 (rows % 4) and Q6_K (rows % 8).
    assert repacked_split(_tiny(), "arm_dotprod") == (3000 + 1000 + 4000, 4000)
    assert repacked_split(untied, "arm_dotprod") == (3000 + 1000 + 500, 0)


def test_budget_parts_and_totals(gemma: ModelFacts) -> None:
    b = compute_budget(
        budget_input(gemma, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, board=board(2))
    )
    names = [p.name for p in b.parts]
    assert names == [
        "weights_mapped",
        "weights_mapped_cold",
        "weights_repacked",
        "kv_cache",
        "output_buffer",
        "compute_buffer",
        "server_runtime",
        "slot_state",
        "server_binary",
        "front_runtime",
        "front_libraries",
    ]
    part = {p.name: p for p in b.parts}
    assert part["kv_cache"].bytes == 36 * MiB and part["kv_cache"].when == "load"
    assert part["compute_buffer"].when == "use" and part["compute_buffer"].kind == "anon"
    assert part["weights_mapped"].bytes + part["weights_mapped_cold"].bytes == mapped_bytes(gemma)
    assert part["output_buffer"].bytes == 262_144 * 4
    assert part["server_binary"].bytes == SERVER_FILE_BYTES
    assert part["front_runtime"].bytes == FRONT_ANON_BYTES
    assert "-fa on" in part["compute_buffer"].note and "off" in part["compute_buffer"].note
    assert b.engine_anon_peak_bytes == sum(
        part[n].bytes
        for n in (
            "weights_repacked",
            "kv_cache",
            "output_buffer",
            "compute_buffer",
            "server_runtime",
            "slot_state",
        )
    )
    assert b.engine_file_bytes == mapped_bytes(gemma) + SERVER_FILE_BYTES
    assert b.service_hot_bytes == b.service_bytes - part["weights_mapped_cold"].bytes
    # 2 compute + 5 HTTP (max(1 + 4, 2 - 1)) + 4 others; the main thread's stack aside.
    assert "11 engine threads" in b.notes["threads"]
    assert b.engine_commit_bytes > 10 * THREAD_STACK_BYTES + b.compute_reserved_bytes


def test_flash_attention_shrinks_the_compute_buffer(gemma: ModelFacts) -> None:
    qwen, _, _ = preset_facts("qwen2.5-0.5b-instruct")
    cells = engine_cells(32768)
    off = compute_reserved_bytes(qwen, cells, 512, False)
    on = compute_reserved_bytes(qwen, cells, 512, True)
    assert off > 900 * MiB and on < 70 * MiB  # the scores: 32768 x 512 x 14 heads x 4 B
    for n_ctx in (512, 8192, 32768):
        b = compute_budget(budget_input(gemma, n_ctx=n_ctx, flash_attn=True))
        cb = b.part("compute_buffer")
        assert cb is not None and cb.bytes <= b.compute_reserved_bytes


def test_resident_compute_follows_the_fill(gemma: ModelFacts) -> None:
    full = compute_budget(budget_input(gemma, n_ctx=32768))
    part = compute_budget(budget_input(gemma, n_ctx=32768, fill_tokens=8192))
    a, b = full.part("compute_buffer"), part.part("compute_buffer")
    assert a is not None and b is not None and b.bytes < a.bytes
    # Without flash attention the softmaxed scores are converted to f16 in the
    # CPU work buffer: half of them again beyond the reservation.
    assert a.bytes == full.compute_reserved_bytes + 32768 * 512 * 4 * 4 // 2


def test_checkpoints_prompt_cache_and_weights_modes(gemma: ModelFacts) -> None:
    small = compute_budget(budget_input(gemma, n_ctx=8192, n_ubatch=512, swa_full=False))
    ckpt = small.part("ctx_checkpoints")
    # 32 checkpoints of the slot's SWA cache: 15 layers x 1024 cells x 1,024 B.
    assert ckpt is not None and ckpt.bytes == 32 * 15 * 1024 * 1024 and ckpt.when == "use"
    assert compute_budget(budget_input(gemma, n_ctx=8192)).part("ctx_checkpoints") is None
    cached = compute_budget(budget_input(gemma, n_ctx=2048, cache_ram_mib=256))
    pc = cached.part("prompt_cache")
    assert pc is not None and pc.bytes == 256 * MiB
    locked = compute_budget(budget_input(gemma, n_ctx=2048, use_mlock=True))
    assert locked.part("weights_mapped_cold") is None  # locked pages are never cold
    wm = locked.part("weights_mapped")
    assert wm is not None and wm.bytes == mapped_bytes(gemma) and "mlock" in wm.note
    read = compute_budget(budget_input(gemma, n_ctx=2048, use_mmap=False))
    assert read.part("weights_loaded") is not None and read.part("weights_mapped") is None
    base = compute_budget(budget_input(gemma, n_ctx=2048))
    assert read.engine_commit_bytes > base.engine_commit_bytes  # the weights are charged


def test_reserves_and_errors(gemma: ModelFacts) -> None:
    b = compute_budget(
        budget_input(
            gemma,
            n_ctx=512,
            board=board(
                npu_reserve_bytes=256 * MiB,
                os_reserve_bytes=512 * MiB,
                business_reserve_bytes=128 * MiB,
            ),
            front_process=False,
        )
    )
    assert b.reserve_bytes == (256 + 512 + 128) * MiB
    assert b.part("front_runtime") is None and b.front_commit_bytes == 0
    with pytest.raises(ValueError, match="must be > 0"):
        compute_budget(budget_input(gemma, n_ctx=0))
    with pytest.raises(ValueError, match="needs flash attention"):
        compute_budget(budget_input(gemma, n_ctx=512, kv_type="q8_0"))
    with pytest.raises(ValueError, match="cannot be budgeted"):
        compute_budget(budget_input(gemma, n_ctx=512, cache_ram_mib=-1))


def test_governor_reads_the_budget_it_expects(gemma: ModelFacts) -> None:
    from slmguard.governor.policy import MemoryModel
    from slmguard.plan.boards import get_profile
    from slmguard.plan.configs import PlanRequest
    from slmguard.plan.planner import make_plan

    plan = make_plan(
        PlanRequest(gemma, get_profile("rk3588-8g"), ctx=4096, engine={"n_parallel": 2})
    )
    model = MemoryModel.from_plan(plan)
    assert model.kv_bytes_per_token == 18_432  # the first part named *kv*: kv_cache
    use = sum(p.bytes for p in plan.budget if p.when == "use" and p.kind == "anon")
    assert model.use_bytes == use > 0


def test_arm_repack_rules_against_the_aarch64_engine(gemma: ModelFacts) -> None:
    """The aarch64 build of the same engine under qemu as a Cortex-A76 (RK3588's big core)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from engine_probe import parse_engine_log

    log = parse_engine_log((FIXTURES / "gemma3-270m_arm-dotprod-qemu_c512.log").read_text())
    # Q4_K, Q6_K and Q8_0 have dotprod kernels (Q5_0 has none), and the tied output's
    # copy of the Q8_0 embedding (170 MiB) is repacked too.
    repacked, tied = repacked_split(gemma, "arm_dotprod")
    assert log["repack_mib"] == round(repacked / MiB, 2) == 193.38
    assert round(tied / MiB, 2) == 170.0
    reserved = compute_reserved_bytes(gemma, engine_cells(512), 64, True)
    assert abs(reserved / MiB - log["compute_mib"]) < 0.05  # the same graph as on x86
    qwen, _, _ = preset_facts("qwen2.5-0.5b-instruct")
    log = parse_engine_log((FIXTURES / "qwen2.5-0.5b-shape_arm-dotprod-qemu_c2048.log").read_text())
    # The preset's tensor sizes are scaled to the published file: within 1 %.
    assert abs(repacked_bytes(qwen, "arm_dotprod") / MiB - log["repack_mib"]) < 0.01 * 208.3
    assert (
        abs(compute_reserved_bytes(qwen, engine_cells(2048), 512, True) / MiB - log["compute_mib"])
        < 0.05
    )


def _minilm_reranker() -> ModelFacts:
    """A BERT cross-encoder of MiniLM's shape (6 layers, 384 wide, 12 heads, 1,536 FFN,
    30,522 WordPiece tokens, rank pooling): the facts of the GGUF measured below."""
    return _tiny(
        arch="bert",
        n_layer=6,
        n_head=12,
        n_head_kv=12,
        key_length=32,
        value_length=32,
        n_embd=384,
        n_vocab=30_522,
        n_ctx_train=512,
        n_ff=1536,
        pooling_type=4,
        causal_attn=False,
        tensors=(
            TensorFacts("token_embd.weight", "F32", (384, 30_522), 0, 46_881_792),
            TensorFacts("blk.0.ffn_up.weight", "F32", (384, 1536), 46_881_792, 2_359_296),
        ),
    )


# The engine's "CPU compute buffer size" (MiB) for BERT rerankers without a KV cache, the
# prompt a full ubatch: llama-server 0.3.36 --reranking, 2 threads, 2026-12-03. tiny: the
# tests' reranker (tests/rerankmodel.py: 64 wide, 4 heads, 2 layers); minilm: above.
NO_KV_COMPUTE_MIB = [
    # model, n_ctx, slots, n_ubatch, flash attention, MiB reported
    ("tiny", 512, 2, 512, False, 5.76),
    ("tiny", 512, 2, 512, True, 1.19),
    ("tiny", 2048, 4, 512, False, 5.76),
    ("tiny", 512, 1, 256, False, 1.63),
    ("tiny", 512, 1, 128, False, 0.50),
    ("minilm", 512, 1, 512, False, 17.51),
    ("minilm", 2048, 4, 512, False, 17.51),
    ("minilm", 512, 1, 512, True, 5.76),
    ("minilm", 512, 2, 256, False, 5.50),
]


def test_a_model_without_a_kv_cache_budgets_no_kv(rerank_model: Path) -> None:
    """llama.cpp runs BERT without a memory module: no KV cache at any context, no
    checkpoints, the compute buffer of one ubatch attending to itself, and an output
    buffer that grows to a ubatch of rows (logits and embeddings, f32)."""
    tiny, minilm = read_model_facts(rerank_model), _minilm_reranker()
    assert not tiny.has_kv_cache and not minilm.has_kv_cache
    for name, n_ctx, slots, ub, fa, mib in NO_KV_COMPUTE_MIB:
        f = tiny if name == "tiny" else minilm
        b = compute_budget(
            budget_input(f, n_ctx=n_ctx, n_batch=ub, n_ubatch=ub, n_threads=2, n_parallel=slots,
                        flash_attn=fa, swa_full=False, board=board(2), front_process=False)
        )  # fmt: skip
        part = {p.name: p for p in b.parts}
        assert part["kv_cache"].bytes == 0 and "without a KV cache" in part["kv_cache"].note
        assert "ctx_checkpoints" not in part
        reserved = b.compute_reserved_bytes / MiB
        # Never below the engine (beyond its two-decimal rounding), at most 20% above.
        assert mib - 2 * LOG_ROUND / MiB <= reserved <= mib * 1.2, (name, n_ctx, slots, ub, fa)
        rows = min(n_ctx, ub)
        assert part["output_buffer"].bytes == rows * (f.n_vocab + f.n_embd) * 4
        assert part["output_buffer"].when == "use"
    # Measured: a 508-token rerank took the MiniLM engine's anonymous RSS from 9.3 to
    # 88.1 MiB (n_ctx 512, -fa off): 60.4 MiB of output rows, 17.5 of compute buffer
    # and the CPU work buffer. The context costs nothing beyond its one ubatch.
    one = compute_budget(budget_input(minilm, n_ctx=512, n_batch=512, n_ubatch=512))
    four = compute_budget(budget_input(minilm, n_ctx=2048, n_batch=512, n_ubatch=512, n_parallel=4))
    out_one, out_four = one.part("output_buffer"), four.part("output_buffer")
    assert out_one is not None and out_four is not None
    assert out_one.bytes == out_four.bytes == 512 * 30_906 * 4
    assert one.compute_reserved_bytes == four.compute_reserved_bytes

"""``slmguard plan`` for a board (issue 39): several models and neighbours under one
budget, the sets that may be resident together, the refusals with their numbers, and
every bad SPEC a 64 naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rerankmodel import write_embedder, write_reranker
from slmguard.cli import main
from slmguard.host.systemd import parse_memory_property
from slmguard.plan.allocation import (
    ENCODER_ANON_PER_VOCAB_BYTES,
    ENCODER_BASE_ANON_BYTES,
    SERVER_BASE_ANON_BYTES,
)
from slmguard.plan.parts import hot_bytes
from slmguard.plan.planfile import load_plan
from slmguard.plan.relations import neighbours_bytes
from slmguard.plan.residency import planned_models, resident_together
from slmguard.plan.schema import BudgetPart, Plan

MiB = 1 << 20
BOARD_KEYS = ("serving", "models", "neighbours", "resident_sets")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 1), out.out + out.err


@pytest.fixture(scope="module")
def encoders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("encoders")
    return write_reranker(d / "rerank.gguf"), write_embedder(d / "embed.gguf")


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> Plan:
    out = tmp_path / "plan.json"
    code, text = _run(["plan", *argv, "--json", "--out", str(out)], capsys)
    assert code == 0, text
    return load_plan(out)


def test_a_two_model_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], encoders: tuple[Path, Path]
) -> None:
    """The embedded Gemma for chat beside an on-demand reranker: the primary's context is
    the largest that fits with the reranker beside it, and both may be resident."""
    rerank, _ = encoders
    alone = _plan(tmp_path, capsys, "--board", "rpi5-4g", "--gpu", "none")
    board = _plan(
        tmp_path, capsys, "--board", "rpi5-4g", "--gpu", "none", "--model", "embedded",
        "--model", f"{rerank},on-demand,name=rerank,alias=bge-reranker,idle-unload=2m",
    )  # fmt: skip
    assert board.serving is not None and board.serving.role == "chat"
    (m,) = board.models
    assert (m.serving.name, m.serving.role, m.serving.residency) == (
        "rerank",
        "rerank",
        "on_demand",
    )
    assert m.serving.idle_unload_s == 120 and m.serving.aliases == ("bge-reranker",)
    assert m.model.path == str(rerank) and m.model.sha256 is not None
    # An encoder: n_batch = n_ubatch = the context per slot; no front, no reserves.
    assert m.engine.n_batch == m.engine.n_ubatch == m.engine.n_ctx == 512
    names = {p.name for p in m.budget}
    assert not names & {"front_runtime", "os_reserve", "business_reserve"}
    assert "kv_cache" in names and "server_runtime" in names
    # The two together at full load stay below the recovery line the primary was planned to.
    (rs,) = board.resident_sets
    assert set(rs.models) == {board.serving.name, "rerank"}
    assert rs.peak_bytes == hot_bytes(board.budget) + hot_bytes(m.budget)
    assert resident_together(board, rs.models)
    line = board.limits.memory_high_bytes * board.watermarks.recover_pct / 100
    assert rs.peak_bytes <= line
    assert board.engine.n_ctx <= alone.engine.n_ctx  # the reranker's room came from the primary
    assert board.limits == alone.limits  # no neighbours: the same zone
    assert "resident_sets" in board.reasons and "models" in board.reasons


def test_the_table_shows_the_models_sets_and_neighbours(
    capsys: pytest.CaptureFixture[str], encoders: tuple[Path, Path]
) -> None:
    rerank, embed = encoders
    code, text = _run(
        ["plan", "--board", "rk3588-4g", "--model", "embedded", "--model", str(embed),
         "--model", f"{rerank},on-demand", "--neighbour", "whisper=600M,unit=whisper.service",
         "--neighbour", "camera=200M,low"],
        capsys,
    )  # fmt: skip
    assert code == 0, text
    for needle in (
        "models  (one engine each", "embedding  pinned", "rerank     on-demand",
        "resident together", "neighbours (in the business slice", "whisper.service  MemoryMin=",
        "(no unit)  MemoryLow=", "neighbours              838,860,800",
        "  neighbours    800 MiB held for the board's other services",
    ):  # fmt: skip
        assert needle in text, needle


def test_a_neighbour_heavy_board_is_planned_in_what_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """1.5 GiB of neighbours on a 4 GB board: the business reserve holds them, MemoryMax
    is that much lower, and the one model still fits (a smaller context)."""
    alone = _plan(tmp_path, capsys, "--board", "rk3588-4g")
    plan = _plan(
        tmp_path, capsys, "--board", "rk3588-4g", "--neighbour", "whisper=1G,unit=whisper.service",
        "--neighbour", "tts=512M,unit=piper-tts.service,low",
    )  # fmt: skip
    held = neighbours_bytes(plan)
    assert held == 1536 * MiB
    assert plan.limits.business_reserve_bytes == alone.limits.business_reserve_bytes + held
    assert plan.limits.memory_max_bytes == alone.limits.memory_max_bytes - held
    assert plan.engine.n_ctx < alone.engine.n_ctx
    assert plan.models == () and plan.resident_sets == () and plan.serving is None
    parts = {p.name: p.bytes for p in plan.budget}
    assert parts["neighbours"] == held
    assert parts["business_reserve"] == alone.limits.business_reserve_bytes
    assert [n.protection for n in plan.neighbours] == ["min", "low"]


def test_one_model_plans_have_none_of_the_board_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], encoders: tuple[Path, Path]
) -> None:
    """``--model FILE`` and ``--preset`` plan as before: no board key in the JSON."""
    rerank, _ = encoders
    for argv in (["--model", str(rerank)], ["--preset", "gemma-3-270m-it"], []):
        _run(["plan", "--board", "rpi5-8g", *argv, "--json", "--out", str(tmp_path / "p")], capsys)
        data = json.loads((tmp_path / "p").read_text())
        assert not set(BOARD_KEYS) & set(data), argv


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            # 3 GB of neighbours on a 4 GB board with its 1,152 MiB of reserves
            ["--board", "rk3588-4g", "--neighbour", "a=3G"],
            ["board rk3588-4g: the neighbours (a 3,072 MiB, 3,072 MiB) with the OS 512 MiB, "
             "business 384 MiB and NPU 256 MiB reserves leave nothing of 4,096 MiB RAM"],
        ),
        (
            # the pinned models and 1,700 MiB of neighbours: not even the smallest context fits
            # (with 1,800 MiB the qwen's commit charge alone is over the recovery line of
            # CommitLimit at ratio 100, refused as a model that does not fit even alone)
            ["--board", "rk3588-4g", "--model", "embedded,ctx=32768", "--model",
             "preset=qwen2.5-0.5b-instruct,ctx=32768", "--neighbour", "whisper=1700M"],
            ["board rk3588-4g: cannot hold its pinned models and neighbours: ",
             "with the board's other models beside it (qwen2.5-0.5b-instruct ",
             "the recovery line is ", "; the neighbours hold 1,700 MiB of it (whisper 1,700 MiB)"],
        ),
        (
            # each fits alone, not together: the on-demand model could never be loaded
            ["--board", "rk3588-4g", "--model", "embedded,ctx=32768", "--model",
             "preset=qwen2.5-0.5b-instruct,ctx=32768,slots=2,on-demand"],
            ["board rk3588-4g: the on-demand model qwen2.5-0.5b-instruct (peak ",
             "could never be loaded beside the pinned models", "its planned peak with the "
             "board's other models beside it (qwen2.5-0.5b-instruct ", "on demand) is "],
        ),
    ],
)  # fmt: skip
def test_a_board_that_cannot_hold_its_models_is_refused_with_the_numbers(
    capsys: pytest.CaptureFixture[str], argv: list[str], needles: list[str]
) -> None:
    code, text = _run(["plan", *argv], capsys)
    assert code == 78, text
    for needle in needles:
        assert needle in text, (needle, text)
    assert "MiB" in text and text.count("\n") <= 3


def test_the_pinned_fit_alone_when_the_on_demand_one_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal above is about the on-demand model: pinned, the primary alone fits."""
    plan = _plan(tmp_path, capsys, "--board", "rk3588-4g", "--model", "embedded,ctx=32768")
    assert plan.engine.n_ctx_slot == 32768


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "a.gguf,role=vision"], "role='vision' is not one of chat, completion"),
        (["--model", "a.gguf,,pinned"], "an empty item"),
        (["--model", "a.gguf,pinned,on-demand"], "give one of pinned and on-demand, once"),
        (["--model", "a.gguf,colour=red"], "unknown key 'colour' (keys: file, preset"),
        (["--model", "a.gguf,slots=0"], "slots=0 is not within 1 to 64"),
        (["--model", "a.gguf,slots=" + "9" * 5000], "is not a whole number"),
        (["--model", "a.gguf,ctx=-1"], "ctx='-1' is not a whole number"),
        (["--model", "a.gguf,priority=1001"], "priority=1001 is not within 0 to 1000"),
        (["--model", "a.gguf,idle-unload=5m"], "idle-unload= is for an on-demand model"),
        (["--model", "a.gguf,on-demand,idle-unload=9d"], "idle-unload='9d' is not SECONDS"),
        (["--model", "a.gguf,on-demand,idle-unload=999h"], "is above 604800 s (a week)"),
        (["--model", "a.gguf,name=a\nb"], "holds a control character"),
        (["--model", "a.gguf,name=-rf"], "name='-rf' is not a model name"),
        (["--model", "a.gguf,name=a b"], "name='a b' is not a model name"),
        (["--model", "a.gguf,name=" + "x" * 200], "is not a model name"),
        (["--model", "embedded,preset=x"], "name one model: FILE, file=FILE, preset=NAME or "),
        (["--model", "name=x"], "name one model"),
        (["--model", "a.gguf,nonsense"], "'nonsense' is neither key=value nor a flag"),
        (["--model", "x" * 9000], "9000 characters (at most 8192)"),
        (["--model", "embedded", "--model", "embedded"], "answers to 'gemma-3-270m-q4_k_m', as"),
        (["--model", "embedded,on-demand"], "the first --model is the primary model"),
        (["--model", "embedded,ctx=512", "--ctx", "1024"], "--ctx 1024 and ctx=512"),
        (["--model", "embedded,slots=2", "--n-parallel", "1"], "and slots=2 in the first"),
        (["--model", "embedded,role=rerank"], "role=rerank, but Gemma 3 270m is no reranker"),
        (["--neighbour", "whisper"], "no size: give NAME=SIZE, or unit=UNIT"),
        (["--neighbour", "whisper=lots"], "size 'lots' is not a size"),
        (["--neighbour", "whisper=600MB"], "size '600MB' is not a size"),
        (["--neighbour", "whisper=0"], "size 0 is not within 1 byte and 1 PiB"),
        (["--neighbour", "whisper=-5M"], "size '-5M' is not a size"),
        (["--neighbour", "whisper=9999999T"], "is not within 1 byte and 1 PiB"),
        (["--neighbour", "whisper=1e9"], "size '1e9' is not a size"),
        (["--neighbour", "who sper=1G"], "name 'who sper': letters, digits and _.-"),
        (["--neighbour", "../x=1G"], "name '../x': letters"),
        (["--neighbour", "w=1G,unit=-H.service"], "unit '-H.service': a systemd service"),
        (["--neighbour", "w=1G,unit=--help"], "unit '--help': a systemd service"),
        (["--neighbour", "w=1G,unit=a b.service"], "unit 'a b.service'"),
        (["--neighbour", "w=1G,unit=x\\x2dy.service"], "unit 'x\\\\x2dy.service'"),
        (["--neighbour", "w=1G,unit=../../etc/x.service"], "unit '../../etc/x.service'"),
        (["--neighbour", "w=1G,unit=w.socket"], "unit 'w.socket': a systemd service"),
        (["--neighbour", "w=1G,unit=slmguard.service"], "unit slmguard.service is one of"),
        (["--neighbour", "w=1G,unit=a.service,unit=b.service"], "each once"),
        (["--neighbour", "w=1G,max"], "'max': the items are unit=NAME.service and min or low"),
        (["--neighbour", "w=1G", "--neighbour", "w=2G"], "--neighbour w: named twice"),
        (
            ["--neighbour", "a=1G,unit=x.service", "--neighbour", "b=1G,unit=x.service"],
            "--neighbour b: unit x.service is another's too",
        ),
        (
            ["--neighbour", "w,unit=whisper.service"],
            "--neighbour w,unit=whisper.service: cannot ask systemd",
        ),
        (["--preset", "gemma-3-270m-it", "--neighbour", "w=1G"], "--neighbour goes with"),
    ],
)
def test_every_bad_spec_is_a_64_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    # --root: a tree with no systemd, so a unit's memory cannot be asked for
    code, text = _run(["plan", "--board", "rk3588-4g", "--root", str(tmp_path), *argv], capsys)
    assert code == 64, text
    assert needle in text, text
    assert "Traceback" not in text


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("629145600", 629145600),
        ("[not set]", None),
        ("18446744073709551615", None),  # UINT64_MAX: no value
        ("", None),
        (None, None),
        ("12 MiB", None),
        ("9" * 30, None),
    ],
)
def test_systemd_memory_properties(value: str | None, expected: int | None) -> None:
    assert parse_memory_property(value) == expected


def test_the_primary_is_listed_first_with_its_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], encoders: tuple[Path, Path]
) -> None:
    _, embed = encoders
    plan = _plan(
        tmp_path, capsys, "--board", "rpi5-8g", "--model", "embedded", "--model", str(embed)
    )
    primary, other = planned_models(plan)
    assert (primary.serving.priority, other.serving.priority) == (100, 50)
    assert (other.serving.name, other.serving.role) == ("embed", "embedding")
    assert other.pinned and len(plan.resident_sets) == 1


def test_an_encoders_heap_is_planned_by_its_vocabulary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], encoders: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """An encoder has no decoding warm-up, no sampler: its heap is a base and its
    vocabulary's entries (RESULTS.md "plan accuracy for a board"), not a decoder's 50 MiB;
    a MiniLM-sized vocabulary (the tests' reranker padded to 30,522 entries) adds to it."""
    import rerankmodel

    own = rerankmodel.vocabulary()
    monkeypatch.setattr(
        rerankmodel, "vocabulary", lambda: own + [f"zz{i:06d}" for i in range(30_522 - len(own))]
    )
    minilm = rerankmodel.write_reranker(tmp_path / "minilm.gguf")
    board = _plan(
        tmp_path, capsys, "--board", "rk3588-4g", "--model", "embedded",
        "--model", str(encoders[0]), "--model", f"{minilm},name=minilm",
    )  # fmt: skip

    def runtime(parts: tuple[BudgetPart, ...]) -> int:
        (p,) = [p for p in parts if p.name == "server_runtime"]
        return p.bytes

    assert runtime(board.budget) == SERVER_BASE_ANON_BYTES
    small, big = (runtime(m.budget) for m in board.models)
    assert small == ENCODER_BASE_ANON_BYTES + ENCODER_ANON_PER_VOCAB_BYTES * len(own)
    assert big == ENCODER_BASE_ANON_BYTES + ENCODER_ANON_PER_VOCAB_BYTES * 30_522
    assert small < 8 * MiB < big < 12 * MiB < SERVER_BASE_ANON_BYTES

"""A plan with a vision projector (``plan --mmproj``): recorded, budgeted, batched, placed.

The projector's file is the tiny one of ``tests/visionmodel.py`` where a file is needed;
the offload choice and the refusals use a SigLIP-so400m shape (Gemma 3's, 851 MB of F16
weights) whose facts are written out, beside the Gemma 3 1B preset.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from slmguard.errors import ConfigError, ModelError, PlanError
from slmguard.plan.boards import ORIN_GPU, get_profile
from slmguard.plan.budget import compute_budget
from slmguard.plan.configs import PlanRequest
from slmguard.plan.inputs import PlanChoices, plan_for
from slmguard.plan.modelfacts import ModelFacts, read_model_facts
from slmguard.plan.overrides import ProjectorOverrides
from slmguard.plan.parts import BudgetInput
from slmguard.plan.planfile import dumps_plan, loads_plan, plan_to_dict
from slmguard.plan.planner import make_plan
from slmguard.plan.presets import preset_facts
from slmguard.plan.projector import (
    ProjectorFacts,
    VisionInput,
    read_projector_facts,
    vision_budget,
)
from slmguard.plan.vision import spec_for
from visionmodel import Projector, write_projector

MiB = 1 << 20


@pytest.fixture(scope="module")
def gemma() -> ModelFacts:
    from slmguard import paths
    from slmguard.default_model import ensure_default_model

    return read_model_facts(ensure_default_model(paths.model_dir()))


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_projector(tmp_path_factory.mktemp("vision") / "mmproj.gguf", Projector())


def so400m(width: int, **over: Any) -> ProjectorFacts:
    """Gemma 3's projector (SigLIP so400m at 896, pooled by 4) for a text model of ``width``."""
    fields: dict[str, Any] = dict(
        path=Path("/models/mmproj-f16.gguf"), name="gemma-3-mmproj", projector_type="gemma3",
        file_bytes=851_000_000, weights_bytes=850_000_000, matmul_type="F16", n_embd=1152,
        n_ff=4304, n_head=16, n_layer=27, image_size=896, patch_size=14, n_merge=4,
        n_embd_out=width, projection_elem_bytes=2.0,
    )  # fmt: skip
    return ProjectorFacts(**{**fields, **over})


def vision(facts: ProjectorFacts, **bounds: Any) -> VisionInput:
    return VisionInput(facts, ProjectorOverrides(bounds=bounds).over(spec_for(facts)))


def one_b() -> ModelFacts:
    return preset_facts("gemma-3-1b-it:Q4_K_M")[0]


def _plan(mmproj: Path, **kw: Any) -> Any:
    choices = PlanChoices(projector=ProjectorOverrides(mmproj=mmproj, bounds=kw.pop("bounds", {})))
    return plan_for(Path("/"), board="rk3588-8g", choices=choices, **kw)[0]


def test_the_plan_records_the_projector_file_and_budgets_its_images(
    mmproj: Path, gemma: ModelFacts, tmp_path: Path
) -> None:
    plan = _plan(mmproj, state_dir=tmp_path)
    v = plan.projector
    import hashlib

    assert v is not None and v.path == str(mmproj.resolve())
    assert v.file_bytes == mmproj.stat().st_size
    assert v.sha256 == hashlib.sha256(mmproj.read_bytes()).hexdigest()
    assert (v.projector_type, v.tokens_per_image, v.offload) == ("gemma3", 16, False)
    assert v.image_max_tokens is None  # gemma3: fixed tokens, nothing to bound
    assert loads_plan(dumps_plan(plan).encode()) == plan  # what every reader reads
    names = {p.name for p in plan.budget}
    assert {"projector_weights", "projector_context", "encoder_compute", "image_slots",
            "image_requests"} <= names  # fmt: skip
    # the parts are plan.projector's arithmetic at the plan's slots and bounds
    facts = read_projector_facts(mmproj)
    e = plan.engine
    want = vision_budget(
        facts, flash_attn=e.flash_attn, n_slots=e.n_parallel, images_per_request=v.max_images,
        data_url_chars=v.max_images * (23 + -(-v.max_image_bytes // 3) * 4),
        decode_bytes=v.max_image_pixels * 22,
    )  # fmt: skip
    vision_parts = sum(p.bytes for p in plan.budget if p.name in names - _text_names(plan, gemma))
    assert vision_parts == want.peak_bytes
    assert "projector" in plan.reasons and "image_tokens" in plan.reasons
    assert "--no-mmproj-offload" in plan.reasons["projector"]


def _text_names(plan: Any, gemma: ModelFacts) -> set[str]:
    return {p.name for p in compute_budget(BudgetInput(gemma, plan.engine)).parts} | {
        "os_reserve", "business_reserve", "npu_reserve",
    }  # fmt: skip


def test_a_plan_without_a_projector_still_loads(gemma: ModelFacts) -> None:
    plan = make_plan(PlanRequest(gemma, get_profile("rk3588-8g"), ctx=2048, model_path="/m.gguf"))
    data = plan_to_dict(plan)
    assert "projector" not in data  # written as an older plan was: no key
    assert loads_plan(json.dumps(data).encode()).projector is None


def test_the_batch_holds_one_image_whole(gemma: ModelFacts) -> None:
    """n_batch = n_ubatch >= an image's tokens, chosen, kept when memory is tight, asked
    for or refused; a plan file that breaks it is refused when read."""
    big = so400m(640)  # 256 tokens an image
    req = PlanRequest(gemma, get_profile("rpi5-4g"), vision=vision(big), model_path="/m.gguf")
    plan = make_plan(req)
    assert plan.engine.n_ubatch == plan.engine.n_batch >= 256
    with pytest.raises(PlanError, match=r"--n-batch 128: a gemma3 projector's image is 256"):
        make_plan(dataclasses.replace(req, engine={"n_batch": 128}))
    data = plan_to_dict(plan)
    data["engine"]["n_ubatch"] = 128
    data["engine"]["n_batch"] = 128
    with pytest.raises(ConfigError, match=r"plan.engine.n_ubatch: 128 is below .* 256 tokens"):
        loads_plan(json.dumps(data).encode())
    data["engine"]["n_ubatch"] = 256
    data["engine"]["n_batch"] = 512
    with pytest.raises(ConfigError, match=r"plan.engine.n_batch: 512 with a projector"):
        loads_plan(json.dumps(data).encode())
    data = plan_to_dict(plan)
    data["projector"]["image_max_tokens"] = 64
    with pytest.raises(ConfigError, match=r"image_max_tokens: a gemma3 projector makes 256"):
        loads_plan(json.dumps(data).encode())


def test_a_slot_must_hold_the_images(gemma: ModelFacts) -> None:
    req = PlanRequest(gemma, get_profile("rk3588-8g"), vision=vision(so400m(640), max_images=4))
    with pytest.raises(PlanError) as err:
        make_plan(dataclasses.replace(req, ctx=1024))
    assert "4 image(s) a request of 260 tokens each need 1296 tokens per slot" in str(err.value)
    assert make_plan(dataclasses.replace(req, ctx=1536)).engine.n_ctx_slot == 1536


def test_images_that_do_not_fit_are_refused_with_their_share(gemma: ModelFacts) -> None:
    req = PlanRequest(
        gemma, get_profile("rpi5-4g"), engine={"n_parallel": 4},
        vision=vision(so400m(640), max_images=64, max_image_bytes=64 * MiB),
    )  # fmt: skip
    with pytest.raises(PlanError) as err:
        make_plan(req)
    e = err.value
    assert e.need_bytes is not None and e.have_bytes is not None and e.need_bytes > e.have_bytes
    assert "the images requests may carry take" in str(e.hint) and "--max-images" in str(e.hint)


def test_more_images_cost_memory_per_slot(gemma: ModelFacts) -> None:
    board = get_profile("rpi5-8g")
    one = make_plan(PlanRequest(gemma, board, vision=vision(so400m(640), max_images=1)))
    many = make_plan(PlanRequest(gemma, board, vision=vision(so400m(640), max_images=4)))

    def per_slot(plan: Any, name: str) -> float:
        return float(next(p.bytes for p in plan.budget if p.name == name)) / plan.engine.n_parallel

    assert per_slot(many, "image_requests") > 3.9 * per_slot(one, "image_requests")
    assert per_slot(many, "image_slots") == 4 * per_slot(one, "image_slots")
    assert many.projector is not None and many.projector.max_images == 4


def test_on_a_gpu_the_projector_goes_there_when_it_fits_else_stays_on_the_host() -> None:
    facts = one_b()
    board = get_profile("jetson-orin-nano-8g")
    v = vision(so400m(facts.n_embd))
    on = make_plan(PlanRequest(facts, board, ctx=4096, gpu=ORIN_GPU, vision=v))
    assert on.engine.n_gpu_layers and on.projector is not None and on.projector.offload
    names = {p.name for p in on.budget}
    assert {"gpu_projector", "gpu_encoder_compute"} <= names and "projector_weights" not in names
    assert "on the GPU" in on.reasons["projector"]
    # a GPU heap that holds the layers but not the projector beside them: the host
    layers = sum(p.bytes for p in on.budget if p.kind == "device" and "projector" not in p.name
                 and "encoder" not in p.name)  # fmt: skip
    small = dataclasses.replace(ORIN_GPU, max_bytes=layers + 100 * MiB)
    host = make_plan(PlanRequest(facts, board, ctx=4096, gpu=small, vision=v))
    assert host.engine.n_gpu_layers == on.engine.n_gpu_layers
    assert host.projector is not None and not host.projector.offload
    assert "projector_weights" in {p.name for p in host.budget}
    assert "the host is the safer side" in host.reasons["projector"]
    # no layer on the GPU: the host, said so
    cpu = make_plan(PlanRequest(facts, board, ctx=4096, vision=v, preset="gemma-3-1b-it"))
    assert cpu.projector is not None and not cpu.projector.offload
    assert "no layer is on a GPU" in cpu.reasons["projector"]
    data = plan_to_dict(cpu)
    data["projector"]["offload"] = True
    with pytest.raises(ConfigError, match=r"plan\.projector\.offload: true but the plan offloads"):
        loads_plan(json.dumps(data).encode())


def test_a_projector_for_another_model_is_refused(tmp_path: Path) -> None:
    other = write_projector(tmp_path / "other.gguf", Projector(n_embd_text=1152))
    with pytest.raises(ModelError, match="width 1152, the model takes 640"):
        _plan(other, digest=False)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    from slmguard.cli import main

    try:
        rc = main(["plan", *args])
    except SystemExit as exit_:
        rc = int(exit_.code or 0)
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize(
    ("args", "rc", "said"),
    [
        (("--max-images", "3"), 64, "--max-images without --mmproj"),
        (("--mmproj", "{p}", "--max-images", "100"), 64, "--max-images 100: must be 1 to 64"),
        (("--mmproj", "{p}", "--ctx", "64"), 78, "need 296 tokens per slot"),
        (("--mmproj", "/nonexistent.gguf"), 66, "no such file"),
        (("--mmproj", "{p}", "--max-images", "1"), 0, "vision  tiny-gemma3-projector"),
    ],
)
def test_plan_cli(
    mmproj: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], rc: int, said: str
) -> None:
    code, out = _cli(capsys, *(a.format(p=mmproj) for a in args), "--board", "rk3588-8g")
    assert code == rc, out
    assert said in out


def test_docs_plan_md_shows_the_vision_plan_this_planner_makes(
    mmproj: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/plan.md's vision example is this planner's output: each of its projector
    lines (parts, totals, reasons) is printed as shown."""
    from slmguard.cli import main

    docs = (Path(__file__).parent.parent / "docs/plan.md").read_text()
    example = docs.split("## Vision: a projector")[1].split("```")[1]
    command = next(x for x in example.splitlines() if x.startswith("$ slmguard plan"))
    shown = [
        x for x in example.splitlines()
        if x.startswith(("projector_", "encoder_", "image_", "service at", "engine  "))
        or x.startswith(("  projector ", "  image_tokens "))
    ]  # fmt: skip
    assert len(shown) == 11, shown
    argv = command.split()[2:]
    argv[argv.index("--mmproj") + 1] = str(mmproj)
    with pytest.raises(SystemExit) as done:
        main(argv)
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    for line in shown:
        assert line in out.splitlines(), line

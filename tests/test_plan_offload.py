"""Offload in the plan: the schema's fields, where llama.cpp puts each weight, the planner's
choice of layers per board's GPU, ``--gpu-layers`` honoured or refused with the numbers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gputrees import LAVAPIPE_HOST
from hosttree import build_tree
from serveproc import default_model_path
from slmguard.cli import main
from slmguard.errors import ConfigError, PlanError, UsageError
from slmguard.plan import offload
from slmguard.plan.boards import PROFILES
from slmguard.plan.inputs import PlanChoices, plan_for
from slmguard.plan.planfile import dumps_plan, load_plan
from slmguard.plan.presets import preset_facts

MIB = 1 << 20


def _model() -> Path:
    path = default_model_path()
    if not path.is_file():
        pytest.skip(f"the default model is not prepared at {path} (make model)")
    return path


def _plan(board: str, ctx: int | None = None, gpu: str = "auto", **engine: Any) -> Any:
    """The plan for the model on ``board``, with these engine settings fixed by name."""
    choices = PlanChoices(engine=engine, gpu=gpu)
    plan, _ = plan_for(Path("/"), model=_model(), board=board, ctx=ctx, choices=choices)
    return plan


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 1), out.out + out.err


# ---------------------------------------------------------------- where the weights go


@pytest.mark.parametrize(
    ("ngl", "output", "layers"),
    [(0, False, ()), (1, True, ()), (2, True, (17,)), (10, True, tuple(range(9, 18))),
     (19, True, tuple(range(18))), (40, True, tuple(range(18)))],
)  # fmt: skip
def test_output_layer_counts_first(ngl: int, output: bool, layers: tuple[int, ...]) -> None:
    got_output, got_layers = offload.offloaded_layers(18, ngl)
    assert (got_output, tuple(sorted(got_layers))) == (output, layers)


def test_tied_embedding_gets_a_device_copy() -> None:
    facts, _, _ = preset_facts("gemma-3-270m-it:Q4_K_M")
    embd = facts.tensor("token_embd.weight")
    assert embd is not None and facts.tensor("output.weight") is None
    none = offload.split_weights(facts, 0)
    assert none.device_bytes == 0 and none.cpu_bytes == facts.tensor_bytes
    full = offload.split_weights(facts, facts.n_layer + 1)
    # Every weight on the device, the embedding twice (input on the CPU, output copy).
    assert full.device_bytes == facts.tensor_bytes
    assert full.cpu_bytes == embd.n_bytes


def test_a_tensor_beyond_the_buffer_range_stays_on_the_cpu() -> None:
    facts, _, _ = preset_facts("gemma-3-270m-it:Q4_K_M")
    embd = facts.tensor("token_embd.weight")
    assert embd is not None and embd.n_bytes > 128 * MIB
    full = offload.split_weights(facts, facts.n_layer + 1, max_tensor_bytes=128 * MIB)
    # lavapipe: the tied output's copy cannot be made; the CPU reads the one mapping.
    assert full.device_bytes == facts.tensor_bytes - embd.n_bytes
    assert full.cpu_bytes == embd.n_bytes


def test_untied_output_moves_not_copies() -> None:
    facts, _, _ = preset_facts("phi-3.5-mini-instruct:Q4_K_M")
    out = facts.tensor("output.weight")
    assert out is not None
    one = offload.split_weights(facts, 1)
    assert one.layers == 0 and one.output
    norm = facts.tensor("output_norm.weight")
    assert one.device_bytes == out.n_bytes + (norm.n_bytes if norm else 0)
    assert one.device_bytes + one.cpu_bytes == facts.tensor_bytes


def test_kv_layers_follow_the_weights_unless_kept_on_the_host() -> None:
    facts, _, _ = preset_facts("qwen2.5-0.5b-instruct:Q4_K_M")
    assert offload.split_kv(facts, 5, True) == frozenset(range(20, 24))
    assert offload.split_kv(facts, 5, False) == frozenset()


# ---------------------------------------------------------------- the planner per board


def test_gpu_auto_offloads_with_cuda_only() -> None:
    orin = _plan("jetson-orin-nano-8g").engine
    assert (orin.backend, orin.device) == ("cuda", "CUDA0") and orin.n_gpu_layers > 0
    for board in ("rk3588-8g", "rpi5-8g"):
        plan = _plan(board)
        e = plan.engine
        assert (e.n_gpu_layers, e.backend, e.device) == (0, "cpu", None), board
        assert plan.limits.device_bytes == 0
        assert "--gpu vulkan plans" in plan.reasons["gpu_layers"], board


def test_gpu_boards_offload_everything_when_asked() -> None:
    for board in ("rk3588-8g", "jetson-orin-nano-8g", "rpi5-8g"):
        gpu = PROFILES[board].gpu
        assert gpu is not None
        plan = _plan(board, gpu=gpu.backend)
        e = plan.engine
        assert (e.n_gpu_layers, e.backend, e.device, e.kv_offload) == (
            plan.model.n_layer + 1,
            gpu.backend,
            gpu.device,
            True,
        ), board
        assert set(gpu.nodes) <= set(plan.board.device_nodes)
        device = sum(p.bytes for p in plan.budget if p.kind == "device" and p.name[:4] == "gpu_")
        # Outside the cgroup (nvmap, kbase): MemoryMax leaves that much out; v3d charges it.
        want_outside = 0 if gpu.in_cgroup else -(-device // MIB) * MIB
        assert plan.limits.device_bytes == want_outside, board
        assert plan.limits.memory_max_bytes + plan.limits.device_bytes <= plan.board.ram_bytes
        assert "gpu_layers" in plan.reasons


def test_outside_device_memory_lowers_memory_max() -> None:
    gpu = _plan("jetson-orin-nano-8g")
    cpu = _plan("jetson-orin-nano-8g", gpu="none")
    assert cpu.engine.n_gpu_layers == 0 and cpu.engine.device is None
    assert cpu.limits.device_bytes == 0
    assert gpu.limits.memory_max_bytes == cpu.limits.memory_max_bytes - gpu.limits.device_bytes


def test_generic_board_stays_on_the_cpu() -> None:
    plan = _plan("generic")
    assert (plan.engine.n_gpu_layers, plan.engine.backend, plan.engine.device) == (0, "cpu", None)


def test_gpu_layers_zero_writes_device_none() -> None:
    plan = _plan("rpi5-8g", n_gpu_layers=0)
    assert (plan.engine.n_gpu_layers, plan.engine.device, plan.engine.backend) == (0, "none", "cpu")
    assert "--gpu-layers 0" in plan.reasons["gpu_layers"]
    # The board's engine is still its Vulkan build, whose code is larger than the CPU's,
    # and which creates the Vulkan instance at start (no device, no pipelines).
    parts = {p.name: p.bytes for p in plan.budget}
    assert parts["server_binary"] == offload.VULKAN_BINARY_NO_DEVICE_FILE_BYTES
    assert parts["gpu_runtime"] == offload.VULKAN_INSTANCE_BYTES
    assert "gpu_weights" not in parts and plan.first_start == ()
    cpu = {p.name: p.bytes for p in _plan("rpi5-8g", gpu="none").budget}
    assert cpu["server_binary"] < parts["server_binary"] and "gpu_runtime" not in cpu


def test_gpu_layers_honoured() -> None:
    plan = _plan("rk3588-8g", n_gpu_layers=7, kv_offload=False)
    assert plan.engine.n_gpu_layers == 7 and not plan.engine.kv_offload
    kv = {p.name: p.bytes for p in plan.budget}
    assert kv["gpu_kv"] == 0 and kv["kv_cache"] > 0
    assert "7 of 19" in plan.reasons["gpu_layers"] and "(requested)" in plan.reasons["gpu_layers"]


def test_gpu_layers_above_the_model_is_refused_with_the_numbers() -> None:
    with pytest.raises(PlanError) as info:
        _plan("rk3588-8g", n_gpu_layers=30)
    assert "--gpu-layers 30" in info.value.message and "at most 19" in info.value.message


def test_gpu_layers_on_a_board_without_gpu() -> None:
    with pytest.raises(PlanError) as info:
        _plan("generic", n_gpu_layers=5)
    assert "has no GPU" in info.value.message


def test_gpu_backend_the_board_lacks() -> None:
    with pytest.raises(UsageError) as info:
        _plan("rpi5-8g", gpu="cuda")
    assert "cannot offload with cuda" in info.value.message


def test_gpu_layers_that_do_not_fit_are_refused_with_the_numbers() -> None:
    with pytest.raises(PlanError) as info:
        _plan("rk3588-4g", n_gpu_layers=19, n_parallel=16, ctx=32768)
    msg = info.value.message
    assert "with 19 layers on the GPU" in msg and "of it on the GPU" in msg
    assert info.value.need_bytes is not None and info.value.have_bytes is not None


def test_vulkan_on_an_auto_host_with_only_lavapipe(tmp_path: Path) -> None:
    root = build_tree(tmp_path, LAVAPIPE_HOST)
    from slmguard.host.gpu import read_gpu
    from slmguard.plan.boards import lavapipe_gpu

    gpu = lavapipe_gpu(read_gpu(root))
    assert gpu is not None and gpu.process_memory and gpu.in_cgroup
    assert gpu.max_bytes == 2 << 30


def test_cli_gpu_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _model()
    out = tmp_path / "plan.json"
    code, _ = _cli(["plan", "--board", "jetson-orin-nano-8g", "--gpu-layers", "10",
                    "--kv-offload", "off", "--json", "--out", str(out)], capsys)  # fmt: skip
    assert code == 0
    e = json.loads(out.read_text())["engine"]
    assert (e["n_gpu_layers"], e["device"], e["kv_offload"], e["backend"]) == (
        10,
        "CUDA0",
        False,
        "cuda",
    )
    code, text = _cli(["plan", "--board", "rpi5-8g", "--gpu", "vulkan"], capsys)
    assert code == 0 and "offload 19 layers on Vulkan0 (vulkan)" in text


def test_cli_bad_gpu_layers(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _cli(["plan", "--preset", "gemma-3-270m-it", "--board", "rpi5-8g",
                       "--gpu-layers", "-1"], capsys)  # fmt: skip
    assert code == 64 and "--gpu-layers -1: must be 0 to" in text


# ---------------------------------------------------------------- hostile plan files


def _bad(tmp_path: Path, mutate: Callable[[dict[str, Any]], object]) -> ConfigError:
    data = json.loads(dumps_plan(_plan("rk3588-8g", gpu="vulkan")))
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        load_plan(path)
    assert info.value.exit_code == 78 and "\n" not in str(info.value)
    return info.value


def _engine(**values: Any) -> Callable[[dict[str, Any]], object]:
    return lambda d: d["engine"].update(values)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_engine(n_gpu_layers=-1), "plan.engine.n_gpu_layers: -1 is below 0"),
        (_engine(n_gpu_layers=10**9), "plan.engine.n_gpu_layers: 1000000000 is above 1025"),
        (_engine(n_gpu_layers=20), "plan.engine.n_gpu_layers: 20 is above the model's 18 layers"),
        (_engine(n_gpu_layers="all"), "plan.engine.n_gpu_layers: expected an integer"),
        (_engine(backend="cpu"), "plan.engine.n_gpu_layers: 19 layers offloaded by backend cpu"),
        (_engine(backend="metal"), "plan.engine.backend: 'metal' is not one of cpu, vulkan, cuda"),
        (_engine(device="none"), "19 layers offloaded to device none"),
        (_engine(device="Vulkan0 --rpc x"), "plan.engine.device: 'Vulkan0 --rpc x' does not match"),
        (_engine(device="Vulkan0\n"), "plan.engine.device: 'Vulkan0\\n' contains a control"),
        (_engine(device="V" * 40), "does not match"),
        (_engine(device=""), "plan.engine.device: '' is empty"),
        (_engine(kv_offload="no"), "plan.engine.kv_offload: expected true/false"),
        (_engine(n_gpu_layers=0, backend="cpu"), "plan.engine.device: Vulkan0 with backend cpu"),
        (
            lambda d: d["limits"].update(device_bytes=8 << 30),
            "plan.limits.device_bytes: 8589934592 beside memory_max_bytes",
        ),
        (lambda d: d["limits"].update(device_bytes=-1), "plan.limits.device_bytes: -1 is below 0"),
    ],
)
def test_hostile_offload_fields(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], object], message: str
) -> None:
    assert message in _bad(tmp_path, mutate).message


def test_cpu_only_plan_files_stay_valid(tmp_path: Path) -> None:
    data = json.loads(dumps_plan(_plan("generic")))
    for key in ("n_gpu_layers", "device", "kv_offload", "backend"):
        del data["engine"][key]
    del data["limits"]["device_bytes"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    e = load_plan(path).engine
    assert (e.n_gpu_layers, e.device, e.kv_offload, e.backend) == (0, None, True, "cpu")


def test_plan_round_trips_with_offload(tmp_path: Path) -> None:
    plan = _plan("jetson-orin-nano-8g")
    path = tmp_path / "plan.json"
    path.write_text(dumps_plan(plan))
    assert dataclasses.asdict(load_plan(path)) == dataclasses.asdict(plan)

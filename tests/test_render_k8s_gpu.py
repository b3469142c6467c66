"""``render --target k8s`` for GPU plans: a CUDA plan's pod asks NVIDIA's device plugin for
the Jetson GPU (validated against Kubernetes' schemas); a Vulkan plan is refused, since no
standard device plugin grants a Mali or v3d GPU and the pod would fail at start."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fleettrees import IMAGE, board_plan
from slmguard.deploy.fleet.k8s import CUDA_RESOURCE, K8sOptions, render_manifests
from slmguard.deploy.fleet.kinds import BoardPlan
from slmguard.errors import RefusedError

K8S_VERSION = "1.33.0"


def _server(bp: BoardPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    (ds,) = [  # the kind's DaemonSet of the nodes but the canary (the same pod)
        doc
        for f in render_manifests((bp,), K8sOptions(image=IMAGE))
        if f.path.endswith("/daemonset.yaml")
        for doc in yaml.safe_load_all(f.content)
        if doc and doc.get("kind") == "DaemonSet"
    ]
    (server,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "server"]
    return ds, server


def test_a_cuda_plans_pod_asks_for_the_jetson_gpu() -> None:
    bp = board_plan("jetson-orin-nano-8g")
    assert bp.plan.engine.backend == "cuda" and bp.plan.engine.n_gpu_layers > 0
    ds, server = _server(bp)
    assert kubernetes_validate.validate(ds, K8S_VERSION, strict=True) == "1.33"
    res = server["resources"]
    assert res["limits"][CUDA_RESOURCE] == res["requests"][CUDA_RESOURCE] == "1"
    assert res["limits"] == res["requests"]  # still Guaranteed QoS


def test_a_cpu_plans_pod_asks_for_no_gpu() -> None:
    bp = board_plan("jetson-orin-nano-8g")
    cpu = replace(bp, plan=replace(bp.plan, engine=replace(
        bp.plan.engine, backend="cpu", n_gpu_layers=0, device=None)))  # fmt: skip
    _, server = _server(cpu)
    assert CUDA_RESOURCE not in server["resources"]["limits"]


def test_a_vulkan_plan_is_refused_with_what_to_do() -> None:
    bp = board_plan("rk3588-8g")
    vulkan = replace(bp, plan=replace(bp.plan, engine=replace(
        bp.plan.engine, backend="vulkan", n_gpu_layers=19, device="Vulkan0")))  # fmt: skip
    with pytest.raises(RefusedError) as err:
        render_manifests((vulkan,), K8sOptions(image=IMAGE))
    assert err.value.exit_code == 78
    assert "offloads 19 layers to Vulkan (Vulkan0)" in str(err.value)
    assert "--gpu none" in (err.value.hint or "") and "slmguard apply" in (err.value.hint or "")

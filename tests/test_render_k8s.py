"""``render --target k8s``: every board preset, validated against Kubernetes' own schemas
and held to our policy (Guaranteed QoS, no ``latest``, nothing privileged, read-only root).

The schemas are those ``kubernetes-validate`` bundles for :data:`K8S_VERSION`
(strict: unknown fields are errors), read offline from the package.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fleettrees import BOARDS, IMAGE, board_plan, fleet, model_path, renamed
from slmguard.cli import main
from slmguard.deploy.fleet import image, k8s, kubelet, monitoring, startup
from slmguard.deploy.fleet.k8s import K8sOptions, render_manifests
from slmguard.deploy.fleet.kinds import BoardPlan
from slmguard.deploy.modelfile import deployed_plan
from slmguard.deploy.render import render_files
from slmguard.deploy.units import PLAN_PATH, UnitOptions, service_unit
from slmguard.plan.planfile import loads_plan
from slmguard.serve.engine import EngineProcess

#: The Kubernetes release the manifests are validated against (k3s v1.33 is current
#: on boards; singleProcessOOMKill needs a kubelet >= 1.32).
K8S_VERSION = "1.33.0"
MiB = 1 << 20


def _docs(files: tuple[Any, ...]) -> dict[str, list[dict[str, Any]]]:
    """The YAML files, parsed (rollout.sh and the dashboard's JSON left out)."""
    return {f.path: list(yaml.safe_load_all(f.content)) for f in files if f.path.endswith(".yaml")}


def _manifests(bps: tuple[BoardPlan, ...], opts: K8sOptions | None = None) -> dict[str, Any]:
    """The workload manifests (not the node files, not monitoring/'s CRDs and dashboard)."""
    files = [f for f in render_manifests(bps, opts or DEFAULT) if f.path.endswith(".yaml")]
    docs = _docs(tuple(files))
    return {
        p: d
        for p, d in docs.items()
        if "kubelet" not in p and "k3s" not in p and not p.startswith("/monitoring/")
    }


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def policy_problems(doc: dict[str, Any]) -> list[str]:
    """Our own rules for a workload document (empty: it complies)."""
    if doc.get("kind") not in ("DaemonSet", "Deployment"):
        return []
    problems = []
    pod = doc["spec"]["template"]["spec"]
    pod_sc = pod.get("securityContext", {})
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        problems.append("host namespaces")
    if pod.get("automountServiceAccountToken") is not False:
        problems.append("service account token mounted")
    for c in _containers(doc):
        name = c["name"]
        res = c.get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        for what in ("memory", "cpu"):
            if what not in req or req.get(what) != lim.get(what):
                problems.append(f"{name}: {what} request {req.get(what)} != limit {lim.get(what)}")
        image = c["image"]
        tag = image.rsplit("/", 1)[-1].split("@")[0].partition(":")[2]
        if "@sha256:" not in image and tag in ("", "latest"):
            problems.append(f"{name}: image {image} is not pinned")
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: privilege escalation allowed")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: writable root file system")
        if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
            problems.append(f"{name}: may run as root")
        if (sc.get("runAsUser", pod_sc.get("runAsUser")) or 0) == 0:
            problems.append(f"{name}: runAsUser 0")
        if sc.get("capabilities", {}).get("drop") != ["ALL"] or sc["capabilities"].get("add"):
            problems.append(f"{name}: capabilities not all dropped")
    for c in spec_containers(doc):
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe not in c:
                problems.append(f"{c['name']}: no {probe}")
    return problems


def spec_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The long-running containers (init containers run to completion: no probes)."""
    return list(doc["spec"]["template"]["spec"]["containers"])


def _cpu(value: str) -> int:
    assert value.isdigit(), f"whole CPUs, not {value!r}"  # exclusive cores need integers
    return int(value)


def _bytes(q: str) -> int:
    for suffix, shift in (("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if q.endswith(suffix):
            return int(q[: -len(suffix)]) << shift
    return int(q)


MIRRORED = K8sOptions(image=IMAGE, model_mirror="https://mirror.example/models")
DEFAULT = K8sOptions(image=IMAGE)


@pytest.mark.parametrize("board", BOARDS)
def test_every_board_validates_and_complies(board: str) -> None:
    model_path()
    bp = board_plan(board)
    for opts in (
        DEFAULT,
        K8sOptions(image=IMAGE, model_claim="slmguard-models"),
        MIRRORED,
    ):
        for path, docs in _manifests((bp,), opts).items():
            for doc in docs:
                if doc["kind"] == "Kustomization":
                    continue
                got = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                assert got == "1.33", (path, got)
                assert policy_problems(doc) == [], path


@pytest.mark.parametrize("board", BOARDS)
def test_the_numbers_are_the_plans(board: str) -> None:
    bp = board_plan(board)
    plan, t = bp.plan, startup.timing(bp.plan)
    docs = _manifests((bp,))
    (ds,) = docs[f"/{bp.slug}/daemonset.yaml"]
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    mem, cpu = c["resources"]["limits"]["memory"], c["resources"]["limits"]["cpu"]
    assert _bytes(mem) == plan.limits.memory_max_bytes
    pinned = plan.cpu_affinity
    if pinned and len(pinned) < len(plan.board.cpus):
        assert _cpu(cpu) == len(pinned)
    else:
        assert _cpu(cpu) == len(plan.board.cpus) - 1
    env = {e["name"]: e["value"] for e in c["env"]}
    assert int(env["SLMGUARD_N_THREADS"]) == min(plan.engine.n_threads, _cpu(cpu))
    assert env["SLMGUARD_LLAMA_SERVER"] == image.CONTAINER_ENGINE
    assert int(env["SLMGUARD_ENGINE_LOAD_TIMEOUT_S"]) >= t.startup_allowance_s
    assert pod["nodeSelector"][kubelet.BOARD_LABEL] == bp.slug
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= t.startup_allowance_s
    assert t.startup_allowance_s >= 2 * t.load_estimate_s
    assert pod["terminationGracePeriodSeconds"] == t.stop_grace_s
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    live = c["livenessProbe"]
    assert live["exec"]["command"][:3] == [image.CONTAINER_PYTHON, "-m", "slmguard.deploy.probe"]
    # The plan the pod reads is byte for byte the one apply installs.
    (cm,) = docs[f"/{bp.slug}/plan-configmap.yaml"]
    text = cm["data"]["plan.json"]
    assert cm["immutable"] is True
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["plan"]["configMap"]["name"] == cm["metadata"]["name"]
    files = render_files(deployed_plan(bp.plan, bp.model), UnitOptions())
    assert text.encode() == next(f.content for f in files if f.path == PLAN_PATH)
    installed = loads_plan(text.encode(), Path("configmap"))
    assert installed.model.sha256 == bp.model.sha256
    assert installed.model.path == bp.model.dest
    assert installed.model.file_bytes == bp.model.size_bytes
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["slmguard.io/plan-sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert annotations["slmguard.io/model-sha256"] == bp.model.sha256


@pytest.mark.parametrize("board", BOARDS)
def test_the_node_reserves_add_up(board: str) -> None:
    bp = board_plan(board)
    plan, n = bp.plan, kubelet.node_numbers(bp)
    (cfg,) = _docs(render_manifests((bp,), DEFAULT))[f"/{bp.slug}/kubelet-config.yaml"]
    o, npu = plan.limits.os_reserve_bytes, plan.board.npu_reserve_bytes
    evict = _bytes(cfg["evictionHard"]["memory.available"])
    system = _bytes(cfg["systemReserved"]["memory"])
    assert evict == n.eviction_bytes >= 100 * MiB
    # every threshold the kubelet has by default is written (one left out would be off)
    assert set(cfg["evictionHard"]) == {
        "memory.available", "nodefs.available", "nodefs.inodesFree",
        "imagefs.available", "imagefs.inodesFree",
    }  # fmt: skip
    assert evict + system == o + npu + plan.limits.device_bytes  # nvmap: outside cgroups
    allocatable = plan.board.ram_bytes - system - evict
    assert allocatable >= plan.limits.memory_max_bytes + plan.limits.business_reserve_bytes
    assert cfg["singleProcessOOMKill"] is True and cfg["failSwapOn"] is True
    assert cfg["enforceNodeAllocatable"] == ["pods"]
    reserved = {int(x) for x in cfg["reservedSystemCPUs"].replace("-", ",").split(",")}
    assert cfg["cpuManagerPolicy"] == "static"
    assert not reserved & set(plan.cpu_affinity)
    assert len(plan.board.cpus) - len(_expand(cfg["reservedSystemCPUs"])) == n.pod_cpus
    (k3s,) = _docs(render_manifests((bp,), DEFAULT))[f"/{bp.slug}/k3s-config.yaml"]
    assert k3s["node-label"] == [f"{kubelet.BOARD_LABEL}={bp.slug}"]
    assert k3s["kubelet-arg"] == [f"config={kubelet.K3S_KUBELET_CONFIG}"]


def test_the_neighbours_on_the_host_are_kept_from_the_pods() -> None:
    """A neighbour with a unit (issue 39) is a host service beside k3s: its memory joins
    systemReserved, so the kubelet never schedules pods into it; one without a unit (a
    pod, or unnamed) stays in the business zone of Node Allocatable."""
    from dataclasses import replace

    from slmguard.errors import SlmguardError
    from slmguard.plan.schema import Neighbour

    bp = board_plan("rk3588-4g")
    held = 300 * MiB
    limits = replace(
        bp.plan.limits,
        business_reserve_bytes=bp.plan.limits.business_reserve_bytes + held,
        memory_max_bytes=bp.plan.limits.memory_max_bytes - held,
        memory_high_bytes=bp.plan.limits.memory_high_bytes - held,
    )
    whisper = Neighbour("whisper", 200 * MiB, unit="whisper.service")
    camera = Neighbour("camera", 100 * MiB, protection="low")
    board = replace(bp, plan=replace(bp.plan, limits=limits, neighbours=(whisper, camera)))

    def reserved(b: BoardPlan) -> tuple[int, str]:
        (cfg,) = _docs(render_manifests((b,), DEFAULT))[f"/{b.slug}/kubelet-config.yaml"]
        text = next(f.content for f in render_manifests((b,), DEFAULT)
                    if f.path == f"/{b.slug}/kubelet-config.yaml").decode()  # fmt: skip
        return _bytes(cfg["systemReserved"]["memory"]), text

    alone, _ = reserved(bp)
    system, text = reserved(board)
    assert system == alone + 200 * MiB == kubelet.node_numbers(board).system_reserved_bytes
    assert "the neighbours on the host (whisper.service) 200 MiB" in text
    n = kubelet.node_numbers(board)
    assert (
        n.allocatable_bytes >= limits.memory_max_bytes + limits.business_reserve_bytes - 200 * MiB
    )
    evil = replace(whisper, unit="x.service\nevictionHard: {}")
    with pytest.raises(SlmguardError, match="is not a service name"):
        reserved(replace(board, plan=replace(board.plan, neighbours=(evil,))))


def _expand(cpus: str) -> set[int]:
    out: set[int] = set()
    for part in cpus.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def test_the_policy_checks_catch_what_they_look_for() -> None:
    bp = board_plan("rk3588-4g")
    (ds,) = _manifests((bp,))[f"/{bp.slug}/daemonset.yaml"]
    assert policy_problems(ds) == []

    def broken(edit: Any) -> list[str]:
        doc = copy.deepcopy(ds)
        edit(doc["spec"]["template"]["spec"]["containers"][0], doc["spec"]["template"]["spec"])
        return policy_problems(doc)

    assert broken(lambda c, p: c["resources"]["requests"].update(memory="2Gi"))  # Burstable
    assert broken(lambda c, p: c["resources"]["requests"].pop("cpu"))
    assert broken(lambda c, p: c.update(image="localhost/slmguard:latest"))
    assert broken(lambda c, p: c.update(image="localhost/slmguard"))
    assert broken(lambda c, p: c["securityContext"].update(privileged=True))
    assert broken(lambda c, p: c["securityContext"].update(readOnlyRootFilesystem=False))
    assert broken(lambda c, p: c["securityContext"].update(allowPrivilegeEscalation=True))
    assert broken(lambda c, p: c["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]))
    assert broken(lambda c, p: p["securityContext"].update(runAsUser=0))
    assert broken(lambda c, p: c.pop("livenessProbe"))
    assert broken(lambda c, p: p.update(hostNetwork=True))
    # and the schema catches what Kubernetes would refuse
    doc = copy.deepcopy(ds)
    doc["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_several_board_kinds_in_one_render() -> None:
    bps = fleet()
    docs = _manifests(bps)
    sets = [d for p, ds in docs.items() if p.endswith(".yaml") and "daemonset" in p for d in ds]
    assert len(sets) == 2 * len(BOARDS)  # each kind's canary and the rest
    assert len({d["metadata"]["name"] for d in sets}) == 2 * len(BOARDS)
    (kust,) = docs["/kustomization.yaml"]
    assert len(kust["resources"]) == 3 + len(BOARDS)  # the DaemonSets go by rollout.sh
    for res in kust["resources"]:
        assert f"/{res}" in docs
    script = next(f for f in render_manifests(bps, DEFAULT) if f.path == "/rollout.sh")
    text = (script.content or b"").decode()
    assert f'KINDS="{" ".join(bp.slug for bp in bps)}"' in text and script.mode == 0o755


HOSTILE = ["x\n- hosts: all", 'a"b\\c: {d}\n---\nkind: Secret', "\u2028ls\x85nel\x00nul"]


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_board_and_model_names_stay_text(name: str) -> None:
    bp = renamed(board_plan("rk3588-4g"), name)
    plain = _manifests((board_plan("rk3588-4g"),))
    docs = _manifests((bp,))
    assert sorted(len(d) for d in docs.values()) == sorted(len(d) for d in plain.values())
    (ds,) = docs[f"/{bp.slug}/daemonset.yaml"]
    assert kubernetes_validate.validate(ds, K8S_VERSION, strict=True)
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["slmguard.io/board-name"] == name
    assert annotations["slmguard.io/model"] == name
    assert ds["spec"]["template"]["spec"]["nodeSelector"][kubelet.BOARD_LABEL] == bp.slug
    (cm,) = docs[f"/{bp.slug}/plan-configmap.yaml"]
    assert json.loads(cm["data"]["plan.json"])["board"]["name"] == name
    for path, d in docs.items():
        assert [x["kind"] for x in d] == [
            x["kind"] for x in plain[path.replace(bp.slug, "rk3588-4g")]
        ]


def test_the_liveness_allowance_is_the_units_watchdog() -> None:
    bp = board_plan("rk3588-4g")
    unit = service_unit(bp.plan, UnitOptions())
    assert f"WatchdogSec={k8s.LIVENESS_PERIOD_S * k8s.LIVENESS_FAILURES}" in unit
    import inspect

    stop = inspect.signature(EngineProcess.stop).parameters["timeout_s"].default
    assert stop == startup.ENGINE_STOP_S


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err


@pytest.mark.parametrize(
    ("extra", "code", "says"),
    [
        ([], 0, "rendered 15 files"),
        (["--image", IMAGE], 0, "create the Secret first"),
        (["--image", ""], 64, "needs --image REF@sha256:DIGEST"),
        (["--image", "registry.example/slmguard:0.1.0"], 64, "pin the image by its digest"),
        (["--image", "registry.example/slmguard:latest@sha256:" + "0" * 64], 64, "'latest'"),
        (["--image", "a b:1"], 64, "not an image reference"),
        (["--namespace", "Bad_NS"], 64, "DNS label"),
        (["--model-claim", "models"], 0, "rendered 15 files"),
        (["--model-mirror", "https://m.example/models"], 0, "rendered 15 files"),
        (["--model-mirror", "file:///etc"], 64, "need an http://"),
        (["--model-mirror", "https://m.example", "--model-claim", "x"], 64, "one way"),
        (["--monitoring-namespace", "Mon_itoring"], 64, "DNS label"),
        (["--package", "x.deb"], 64, "--package does not apply to --target k8s"),
        (["--protect", "nginx.service"], 64, "--protect does not apply to --target k8s"),
        (["--root", "/"], 64, "--root does not apply"),
    ],
)
def test_cli(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    code: int,
    says: str,
) -> None:
    from slmguard.plan.planfile import dumps_plan

    bp = board_plan("rpi5-8g")
    plan = tmp_path / "plan.json"
    plan.write_text(dumps_plan(bp.plan))
    out = tmp_path / "out"
    image = [] if "--image" in extra else ["--image", IMAGE]
    argv = ["render", "--target", "k8s", "--plan", str(plan), "--out", str(out), *image]
    got, text = _run([*argv, *extra], capsys)
    assert (got, says in text) == (code, True), text
    if code == 0:
        assert (out / "rpi5-8g" / "daemonset.yaml").is_file()
        assert (out / "rpi5-8g" / "daemonset-canary.yaml").is_file()


def test_cli_refuses_two_plans_for_one_board(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from slmguard.plan.planfile import dumps_plan

    bp = board_plan("rpi5-8g")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(dumps_plan(bp.plan))
    b.write_text(dumps_plan(bp.plan))
    argv = [
        "render",
        "--target",
        "k8s",
        "--plan",
        str(a),
        "--plan",
        str(b),
        "--out",
        str(tmp_path / "o"),
    ]
    code, text = _run(argv, capsys)
    assert code == 78 and "one plan per board kind" in text
    code, text = _run(
        [*argv[:7], "--out", str(tmp_path / "p"), "--model", str(model_path())], capsys
    )
    assert code == 64 and "--model, --mmproj and --board-model go with one --plan" in text


def test_the_plan_s_configmap_is_named_by_its_hash_so_rollout_undo_restores_both() -> None:
    """Two plans for one board kind: two ConfigMaps, each DaemonSet revision names its own.

    ``kubectl rollout undo`` brings back the earlier pod template, which names the
    earlier ConfigMap (kept: immutable, applied without --prune), so the plan comes back
    with it, and a pod restarted mid-rollout keeps the plan of its revision.
    """
    from dataclasses import replace

    bp = board_plan("rk3588-8g")
    other = replace(bp, plan=replace(bp.plan, engine=replace(bp.plan.engine, n_ctx=1024)))
    first, second = _manifests((bp,)), _manifests((other,))
    names = []
    for docs in (first, second):
        (cm,) = docs[f"/{bp.slug}/plan-configmap.yaml"]
        (ds,) = docs[f"/{bp.slug}/daemonset.yaml"]
        volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
        assert volumes["plan"]["configMap"]["name"] == cm["metadata"]["name"]
        digest = hashlib.sha256(cm["data"]["plan.json"].encode()).hexdigest()
        assert cm["metadata"]["name"] == f"slmguard-{bp.slug}-plan-{digest[:10]}"
        names.append(cm["metadata"]["name"])
    assert names[0] != names[1]
    # The same plan renders the same name: applying again changes nothing.
    (again,) = _manifests((bp,))[f"/{bp.slug}/plan-configmap.yaml"]
    assert again["metadata"]["name"] == names[0]


def test_each_pod_makes_its_own_admin_token_and_a_mirror_fills_the_node_cache() -> None:
    bp = board_plan("rpi5-8g")
    claim = K8sOptions(image=IMAGE, model_claim="models")
    for opts, level in ((DEFAULT, "privileged"), (MIRRORED, "privileged"), (claim, "restricted")):
        docs = _manifests((bp,), opts)
        (ns,) = docs["/namespace.yaml"]
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == level
        (ds,) = docs[f"/{bp.slug}/daemonset.yaml"]
        pod = ds["spec"]["template"]["spec"]
        (server,) = pod["containers"]
        token = server["args"][server["args"].index("--admin-token-file") + 1]
        init = {c["name"]: c for c in pod["initContainers"]}
        assert init["admin-token"]["command"][-2:] == ["admin-token", token]
        secrets = next(v for v in pod["volumes"] if v["name"] == "secrets")
        assert [i["key"] for i in secrets["secret"]["items"]] == ["api-key"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in server["volumeMounts"] if m["name"] == "models"]
        assert mount["readOnly"]
        if opts is MIRRORED:
            # The node's cache by sha256: downloaded once, mounted read-only for the server.
            cmd = init["model"]["command"]
            assert cmd[cmd.index("--sha256") + 1] == bp.model.sha256
            assert int(cmd[cmd.index("--size") + 1]) == bp.model.size_bytes
            assert cmd[cmd.index("--url") + 1].startswith("https://mirror.example/models/")
            assert cmd[cmd.index("--cache") + 1] == k8s.MODEL_CACHE
            assert volumes["models"]["hostPath"] == {"path": k8s.MODEL_CACHE, "type": "Directory"}
            # the model file itself, at the path the deployed plan names
            assert mount["mountPath"] == bp.model.dest
            assert mount["subPath"] == f"{bp.model.sha256}/{Path(bp.model.dest).name}"
        else:
            assert mount["mountPath"] == "/var/lib/slmguard-models"
            assert "model" not in init and "subPath" not in mount
        assert policy_problems(ds) == []


def test_a_canary_node_takes_a_new_plan_first_held_ready() -> None:
    bp = board_plan("rk3588-8g")
    docs = _manifests((bp,))
    (canary,) = docs[f"/{bp.slug}/daemonset-canary.yaml"]
    (rest,) = docs[f"/{bp.slug}/daemonset.yaml"]
    for ds in (canary, rest):
        assert ds["spec"]["minReadySeconds"] == startup.MIN_READY_S
        assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
        assert kubernetes_validate.validate(ds, K8S_VERSION, strict=True)
    pod_c, pod_r = (ds["spec"]["template"]["spec"] for ds in (canary, rest))
    assert pod_c["nodeSelector"][k8s.CANARY_LABEL] == "true"
    (term,) = pod_r["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"] == [
        {"key": k8s.CANARY_LABEL, "operator": "NotIn", "values": ["true"]}
    ]
    assert canary["spec"]["selector"] != rest["spec"]["selector"]
    assert rest["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "10%"
    script = next(f for f in render_manifests((bp,), DEFAULT) if f.path == "/rollout.sh")
    lines = (script.content or b"").decode().splitlines()
    canary_at = lines.index('    kubectl apply -f "$kind/daemonset-canary.yaml"')
    wait_at = next(i for i, ln in enumerate(lines) if "rollout status" in ln and "canary" in ln)
    rest_at = lines.index('    kubectl apply -f "$kind/daemonset.yaml"')
    assert canary_at < wait_at < rest_at and lines[1].startswith("# Rendered by slmguard")
    assert "set -eu" in lines  # a canary that is not available stops the script


def test_the_network_policy_lets_in_clients_and_prometheus_only() -> None:
    docs = _manifests(
        (board_plan("rk3588-4g"),), K8sOptions(image=IMAGE, monitoring_namespace="obs")
    )
    (np,) = docs["/networkpolicy.yaml"]
    assert kubernetes_validate.validate(np, K8S_VERSION, strict=True)
    rules = np["spec"]["ingress"]
    assert rules[0]["from"][0]["podSelector"]["matchLabels"] == {k8s.CLIENT_LABEL: "true"}
    assert rules[1]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "obs"
    }
    assert np["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "slmguard"}


def _monitoring(opts: K8sOptions) -> dict[str, Any]:
    files = render_manifests((board_plan("rk3588-8g"),), opts)
    return {f.path: f.content for f in files if f.path.startswith("/monitoring/")}


def test_monitoring_manifests_have_their_shape() -> None:
    files = _monitoring(K8sOptions(image=IMAGE, namespace="edge"))
    (sm,) = yaml.safe_load_all(files["/monitoring/servicemonitor.yaml"])
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    (endpoint,) = sm["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    assert endpoint["authorization"]["credentials"] == {
        "name": "slmguard-secrets",
        "key": "api-key",
    }
    (rule,) = yaml.safe_load_all(files["/monitoring/prometheusrule.yaml"])
    alerts = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(alerts) == {a.name for a in monitoring.ALERTS}
    assert all('namespace="edge"' in r["expr"] for r in alerts.values())
    (cm,) = yaml.safe_load_all(files["/monitoring/grafana-dashboard.yaml"])
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(cm["data"]["slmguard.json"])
    assert board == json.loads(files["/monitoring/slmguard-dashboard.json"])
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) == len(monitoring.PANELS)
    assert kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    (kust,) = yaml.safe_load_all(files["/monitoring/kustomization.yaml"])
    assert {f"/monitoring/{r}" for r in kust["resources"]} <= set(files)


#: Series the alerts and the dashboard read from outside slmguard: cAdvisor and
#: kube-state-metrics.
EXTERNAL = {"container_oom_events_total", "kube_pod_container_status_restarts_total"}


@pytest.mark.engine
def test_every_metric_the_alerts_and_dashboard_use_is_one_the_server_exports(
    server: Any,
) -> None:
    import re
    import urllib.request

    # A labelled counter appears with its first observation: one completion first.
    body = json.dumps({"model": "gemma-3-270m-q4_k_m", "prompt": "Hi", "max_tokens": 1})
    req = urllib.request.Request(
        server.url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        exported = set(re.findall(r"^(slmguard_[a-z_]+)", resp.read().decode(), re.M))
    files = _monitoring(DEFAULT)
    rules, dashboard = "/monitoring/prometheusrule.yaml", "/monitoring/slmguard-dashboard.json"
    used_text = (
        files[rules].decode() + files[dashboard].decode()
    )  # (vermin: str.decode on d["..."])
    used = set(re.findall(r"\b([a-z_]+(?:_total|_bytes|_level|_state|_depth))\b", used_text))
    used = {u for u in used if u.startswith(("slmguard_", "container_", "kube_"))}
    assert used - EXTERNAL, "the check looks at something"
    assert used - EXTERNAL <= exported, sorted(used - EXTERNAL - exported)


# ------------------------------------------- a board of several models, a projector (39, 42)


def _board_kind(tmp: Path, rerank_name: str = "rerank.gguf") -> BoardPlan:
    from boardfiles import files_plan
    from slmguard.deploy.fleet.kinds import board_plans
    from slmguard.deploy.modelfile import board_models, planned_model

    _, plan = files_plan(tmp, rerank_name)
    (bp,) = board_plans([(plan, planned_model(plan, None), board_models(plan))])
    return bp


@pytest.mark.parametrize("opts", [DEFAULT, MIRRORED], ids=["node-models", "mirror"])
def test_a_board_s_models_and_projector_are_each_mounted_checked_and_passed(
    tmp_path: Path, opts: K8sOptions
) -> None:
    """Every file of the plan reaches the server where the deployed plan names it (serve
    checks each by size and sha256 at start); with a mirror, one init container a file
    fills the node's cache; the projector is passed as the unit passes it (--mmproj)."""
    bp = _board_kind(tmp_path)
    assert [f.kind for f in bp.files] == ["model", "model", "projector"]
    docs = _manifests((bp,), opts)
    (cm,) = docs[f"/{bp.slug}/plan-configmap.yaml"]
    deployed = loads_plan(cm["data"]["plan.json"].encode(), "configmap")
    placed = (deployed.model, *(m.model for m in deployed.models), deployed.projector)
    for f, spec in zip(bp.files, placed, strict=True):
        assert spec is not None
        assert (spec.path, spec.file_bytes, spec.sha256) == (f.dest, f.size_bytes, f.sha256)
        assert spec.path.startswith("/var/lib/slmguard-models/")
    for path in (f"/{bp.slug}/daemonset.yaml", f"/{bp.slug}/daemonset-canary.yaml"):
        (ds,) = docs[path]
        assert kubernetes_validate.validate(ds, K8S_VERSION, strict=True) == "1.33"
        assert policy_problems(ds) == []
        pod = ds["spec"]["template"]["spec"]
        (server,) = pod["containers"]
        assert server["args"][-2:] == ["--mmproj", "/var/lib/slmguard-models/mmproj-tiny.gguf"]
        mounts = [m for m in server["volumeMounts"] if m["name"] == "models"]
        init = {c["name"]: c["command"] for c in pod["initContainers"]}
        if opts is DEFAULT:
            assert mounts == [{"name": "models", "mountPath": k8s.MODEL_DIR, "readOnly": True}]
            assert set(init) == {"admin-token"}
            continue
        assert [m["mountPath"] for m in mounts] == [f.dest for f in bp.files]
        assert [m["subPath"] for m in mounts] == [
            f"{f.sha256}/{Path(f.dest).name}" for f in bp.files
        ]
        assert set(init) == {"admin-token", "model", "model-2", "projector"}
        for step, f in zip(("model", "model-2", "projector"), bp.files, strict=True):
            cmd = init[step]
            assert cmd[cmd.index("--sha256") + 1] == f.sha256
            assert int(cmd[cmd.index("--size") + 1]) == f.size_bytes
            assert cmd[cmd.index("--name") + 1] == Path(f.dest).name
            assert cmd[cmd.index("--url") + 1] == (
                f"https://mirror.example/models/{Path(f.dest).name}"
            )


def test_hostile_file_names_of_a_board_stay_plain_names_under_the_model_dir(
    tmp_path: Path,
) -> None:
    """A board model's file named with YAML, shell and path text: every name the manifests
    carry is the reduced file name, under the model directory; the manifests still parse
    and validate."""
    evil = "x\"'; $(touch y) {{z}}: - [a] #.gguf"
    bp = _board_kind(tmp_path, evil.replace("/", "_"))
    rerank = bp.others[0]
    name = Path(rerank.dest).name
    assert rerank.dest == f"{k8s.MODEL_DIR}/{name}" and "/" not in name
    assert set(name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-")
    docs = _manifests((bp,), MIRRORED)
    (ds,) = docs[f"/{bp.slug}/daemonset.yaml"]
    assert kubernetes_validate.validate(ds, K8S_VERSION, strict=True) == "1.33"
    pod = ds["spec"]["template"]["spec"]
    cmd = next(c["command"] for c in pod["initContainers"] if c["name"] == "model-2")
    assert cmd[cmd.index("--name") + 1] == name
    assert "$(" not in cmd[cmd.index("--url") + 1] and " " not in cmd[cmd.index("--url") + 1]


def test_two_different_files_on_one_name_are_refused(tmp_path: Path) -> None:
    """The rerank file named like the model (other bytes): both would be the board's
    /var/lib/slmguard-models/m.gguf; refused (78) before anything is rendered."""
    from slmguard.errors import RefusedError

    (tmp_path / "r").mkdir()
    with pytest.raises(RefusedError, match="two different files as /var/lib/slmguard-models/"):
        _board_kind(tmp_path, "r/m.gguf")


def test_cli_renders_a_board_plan_with_a_projector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal (78) is gone: render names every file it does not write."""
    from boardfiles import files_plan

    plan, _ = files_plan(tmp_path / "plan")
    out = tmp_path / "out"
    argv = ["render", "--target", "k8s", "--plan", str(plan), "--out", str(out)]
    code, text = _run([*argv, "--image", IMAGE, "--model-mirror", "https://m.example/x"], capsys)
    assert code == 0, text
    ds = (out / "rk3588-4g/daemonset.yaml").read_text()
    for name in ("m.gguf", "rerank.gguf", "mmproj-tiny.gguf"):
        assert f"https://m.example/x/{name}" in ds

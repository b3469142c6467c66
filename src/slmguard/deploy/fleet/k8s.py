"""Kubernetes/k3s manifests from plans: one DaemonSet per board kind, with the plan's numbers.

Owns ``render --target k8s``: pure text from the plans (each with its model, checked by
:mod:`slmguard.deploy.modelfile`) and :class:`K8sOptions`. Per board kind: a canary and
a rest DaemonSet on the nodes labelled ``slmguard.io/board=<slug>`` (``maxSurge: 0``,
:data:`MAX_UNAVAILABLE`, ``minReadySeconds``; ``rollout.sh`` applies the canary first),
Guaranteed QoS with the plan's MemoryMax and whole CPUs, the plan as a ConfigMap (the
``plan.json`` apply installs; its sha256 an annotation), every file of the plan (the
model, a board's other models, the vision projector) from the node's models, a claim
or the sha256-keyed node cache :data:`MODEL_CACHE` filled by one init container a
file, the probes and grace period of :mod:`slmguard.deploy.fleet.startup`, the
secrets as files from one Secret the operator creates (nothing secret rendered), a
hardened pod (UID 65532, read-only root, no capabilities) and images by digest.
``docs/fleet.md`` (A k3s cluster) gives every number's source and each choice's reason
(a hostPath cache over an image volume, Pod Security levels).

It must not write YAML by hand: every string from a plan goes through
:mod:`slmguard.deploy.fleet.yamltext` (quoted, escaped); names and labels come from the
board's slug (:mod:`slmguard.deploy.fleet.kinds`). Node settings are
:mod:`slmguard.deploy.fleet.kubelet`'s.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from slmguard import __version__
from slmguard.deploy.fleet import monitoring, yamltext
from slmguard.deploy.fleet.image import CONTAINER_ENGINE, CONTAINER_PYTHON, CONTAINER_UID
from slmguard.deploy.fleet.kinds import BoardPlan
from slmguard.deploy.fleet.kubelet import (
    BOARD_LABEL,
    K3S_KUBELET_CONFIG,
    NodeNumbers,
    k3s_dropin,
    kubelet_config,
    node_numbers,
    quantity,
)
from slmguard.deploy.fleet.mirror import check_mirror, model_file_name, model_url
from slmguard.deploy.fleet.startup import Timing, timing
from slmguard.deploy.fleet.yamltext import Commented, Literal
from slmguard.deploy.modelfile import MODEL_DIR, ModelSource, deployed_plan
from slmguard.deploy.render import RenderedFile, render_files
from slmguard.deploy.units import PLAN_PATH, STATE_DIR, THREAD_ENV, UnitOptions
from slmguard.errors import RefusedError, UsageError

PORT = 8080
SECRET_DIR = "/run/secrets/slmguard"
RUNTIME_DIR = "/run/slmguard"
API_KEY = "api-key"
#: The pod's own admin token, made by its first init container (memory-backed).
ADMIN_TOKEN_FILE = f"{RUNTIME_DIR}/admin-token"
PODINIT = "slmguard.deploy.fleet.podinit"
#: Hex digits of the plan's sha256 in its ConfigMap's name.
PLAN_HASH_CHARS = 10
#: The node's model cache (``--model-mirror``): ``<sha256>/<file>``, kept across pods; the
#: node's Ansible role (``slmguard_kubernetes_node``) makes it, owned by the pods' user.
MODEL_CACHE = f"{MODEL_DIR}/by-sha256"
#: The label of the node(s) of each kind that take a new plan first.
CANARY_LABEL = "slmguard.io/canary"
#: How many of the other nodes of a kind take the new pod at once (after the canary).
MAX_UNAVAILABLE = "10%"
MiB = 1 << 20
#: The label a client pod needs for the NetworkPolicy to let it in.
CLIENT_LABEL = "slmguard.io/client"
#: Every container's: non-root, nothing to escalate to, no capability, read-only root.
_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}
#: Liveness: period x failures = the 30 s the systemd unit gives a hung front.
LIVENESS_PERIOD_S = 10
LIVENESS_FAILURES = 3
STARTUP_PERIOD_S = 10
APP = "slmguard"

_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")
# registry/name[:tag][@sha256:digest], the OCI reference grammar's characters.
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]*(@sha256:[0-9a-f]{64})?")


@dataclass(frozen=True)
class K8sOptions:
    """What the manifests need besides the plans.

    Example::

        K8sOptions(image="registry.example/slmguard:0.1.0@sha256:" + "0" * 64,
                   model_claim="models")
    """

    image: str = ""  # REF@sha256:DIGEST: required
    namespace: str = "slmguard"
    secret: str = "slmguard-secrets"
    model_claim: str | None = None  # None: the node's /var/lib/slmguard-models
    model_mirror: str | None = None  # a base URL: each pod downloads the model (restricted)
    monitoring_namespace: str = "monitoring"  # Prometheus's: let in by the NetworkPolicy

    @property
    def restricted(self) -> bool:
        """Whether the namespace stays at Pod Security "restricted" (no hostPath model)."""
        return self.model_claim is not None


def validate_options(opts: K8sOptions) -> None:
    """UsageError (64) for a name Kubernetes would refuse or an image without a version."""
    names = (
        ("--namespace", opts.namespace),
        ("secret", opts.secret),
        ("--monitoring-namespace", opts.monitoring_namespace),
    )
    for what, value in names:
        if not _DNS_LABEL.fullmatch(value):
            raise UsageError(f"{what} {value!r}: need a DNS label (a-z, 0-9, '-', <= 63)")
    if opts.model_claim is not None and not _DNS_SUBDOMAIN.fullmatch(opts.model_claim):
        raise UsageError(f"--model-claim {opts.model_claim!r}: not a PersistentVolumeClaim name")
    if opts.model_claim is not None and opts.model_mirror is not None:
        raise UsageError("--model-claim and --model-mirror: give the model one way")
    if opts.model_mirror is not None:
        check_mirror(opts.model_mirror)
    image = opts.image
    if not image:
        raise UsageError(
            "--target k8s needs --image REF@sha256:DIGEST: the server image, pinned by digest",
            hint="build it from container/Containerfile (docs/fleet.md), then podman image "
            "inspect --format '{{.Digest}}' IMAGE",
        )
    last = image.rsplit("/", 1)[-1]
    if not _IMAGE.fullmatch(image) or len(image) > 512:
        raise UsageError(f"--image {image!r}: not an image reference")
    tag = last.split("@", 1)[0].partition(":")[2]
    if "@sha256:" not in image:
        raise UsageError(
            f"--image {image!r}: pin the image by its digest (REF@sha256:...): a tag can move, "
            "a digest names the bytes every node runs",
            hint=f"e.g. --image registry.example/slmguard:{__version__}@sha256:<digest> (podman "
            "image inspect --format '{{.Digest}}' IMAGE, or the registry's)",
        )
    if tag == "latest":
        raise UsageError(f"--image {image!r}: never 'latest', even with a digest")


def _name(bp: BoardPlan, what: str = "") -> str:
    return f"{APP}-{bp.slug}{'-' + what if what else ''}"[:63].rstrip("-")


def _labels(bp: BoardPlan | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": APP, "app.kubernetes.io/version": __version__}
    if bp is not None:
        labels |= {"app.kubernetes.io/instance": _name(bp), BOARD_LABEL: bp.slug}
    return labels


def deployed_plan_text(bp: BoardPlan) -> str:
    """The plan.json ``apply`` would install for this board (the same renderer's bytes)."""
    files = render_files(deployed_plan(bp.plan, bp.model, bp.others), UnitOptions())
    plan_file = next(f for f in files if f.path == PLAN_PATH)
    return (plan_file.content or b"").decode()


def network_policy(opts: K8sOptions) -> str:
    """Who may reach the servers: labelled clients, and Prometheus for /metrics."""
    port = [{"port": "http", "protocol": "TCP"}]
    doc = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": APP, "namespace": opts.namespace, "labels": _labels()},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": APP}},
            "policyTypes": ["Ingress"],
            "ingress": [
                Commented(
                    {
                        "from": [
                            {
                                "namespaceSelector": {},
                                "podSelector": {"matchLabels": {CLIENT_LABEL: "true"}},
                            }
                        ],
                        "ports": port,
                    },
                    f"Client pods of any namespace labelled {CLIENT_LABEL}=true (each still "
                    "needs the API key).",
                ),
                Commented(
                    {
                        "from": [
                            {
                                "namespaceSelector": {
                                    "matchLabels": {
                                        "kubernetes.io/metadata.name": opts.monitoring_namespace
                                    }
                                }
                            }
                        ],
                        "ports": port,
                    },
                    f"Prometheus, in namespace {opts.monitoring_namespace} (monitoring/).",
                ),
            ],
        },
    }
    return yamltext.dump(
        doc, "Nothing else reaches the servers (the kubelet's probes come from the node)."
    )


def plan_configmap_name(bp: BoardPlan, plan_text: str) -> str:
    """The plan's ConfigMap: its name carries the plan's hash, so a DaemonSet revision names
    its own plan (``kubectl rollout undo`` brings both back) and a pod restarted mid-rollout
    keeps the plan of its revision."""
    digest = hashlib.sha256(plan_text.encode()).hexdigest()[:PLAN_HASH_CHARS]
    return f"{APP}-{bp.slug}-plan-{digest}"


def namespace(opts: K8sOptions) -> str:
    level = "restricted" if opts.restricted else "privileged"
    where = "the node's model cache" if opts.model_mirror else "the node's models"
    why = (
        "Pod Security: restricted (the model comes from a PersistentVolumeClaim)."
        if opts.restricted
        else f"Pod Security: privileged, because the model is a hostPath volume ({where}; "
        "baseline forbids hostPath);\nthe pods themselves meet the restricted profile: warn "
        "and audit say so. --model-claim keeps it restricted."
    )
    doc = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": opts.namespace,
            "labels": Commented(
                {
                    **_labels(),
                    "pod-security.kubernetes.io/enforce": level,
                    "pod-security.kubernetes.io/warn": "restricted",
                    "pod-security.kubernetes.io/audit": "restricted",
                },
                why,
            ),
        },
    }
    return yamltext.dump(doc, "The namespace of the slmguard servers.")


def service(opts: K8sOptions) -> str:
    doc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": APP, "namespace": opts.namespace, "labels": _labels()},
        "spec": {
            "selector": {"app.kubernetes.io/name": APP},
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
            "internalTrafficPolicy": Commented(
                "Local", "A client pod reaches the model server of its own board, never another's."
            ),
        },
    }
    return yamltext.dump(doc, "One Service for every board's server (API key required).")


def plan_configmap(bp: BoardPlan, opts: K8sOptions) -> str:
    text = deployed_plan_text(bp)
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": plan_configmap_name(bp, text),
            "namespace": opts.namespace,
            "labels": _labels(bp),
        },
        "immutable": Commented(
            True, "A new plan is a new ConfigMap (its name has the plan's hash); keep old ones."
        ),
        "data": {"plan.json": Literal(text)},
    }
    return yamltext.dump(
        doc,
        f"The plan for {bp.slug} boards: the {PLAN_PATH} `slmguard apply` installs.\n"
        "Apply without --prune: the DaemonSet's earlier revisions name earlier plans.",
    )


def _env(bp: BoardPlan, cpus: int, load_timeout_s: int) -> list[object]:
    threads = min(bp.plan.engine.n_threads, cpus)
    env: list[object] = [
        Commented(
            {"name": "SLMGUARD_N_THREADS", "value": str(threads)},
            f"Engine threads: the plan's {bp.plan.engine.n_threads}, at most the {cpus} CPUs "
            "of the pod's limit.",
        ),
        *({"name": name, "value": str(threads)} for name in THREAD_ENV),
        Commented(
            {"name": "SLMGUARD_LLAMA_SERVER", "value": CONTAINER_ENGINE},
            "The image's engine, whatever path the plan names.",
        ),
        {"name": "SLMGUARD_STATE_DIR", "value": STATE_DIR},
        {"name": "RUNTIME_DIRECTORY", "value": RUNTIME_DIR},
        Commented(
            {"name": "SLMGUARD_ENGINE_LOAD_TIMEOUT_S", "value": str(load_timeout_s)},
            "The start-up allowance (never below the server's own default).",
        ),
        Commented(
            {"name": "MALLOC_ARENA_MAX", "value": "2"},
            "glibc makes an arena per thread; two keep RSS predictable.",
        ),
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
    ]
    return env


def _model_volume(bp: BoardPlan, opts: K8sOptions) -> dict[str, object]:
    if opts.model_claim:
        return {
            "name": "models",
            "persistentVolumeClaim": {"claimName": opts.model_claim, "readOnly": True},
        }
    if opts.model_mirror:
        return {"name": "models", "hostPath": {"path": MODEL_CACHE, "type": "Directory"}}
    return {"name": "models", "hostPath": {"path": MODEL_DIR, "type": "Directory"}}


def _probe_http(period_s: int, timeout_s: int, failures: int) -> dict[str, object]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failures,
    }


#: The extended resource NVIDIA's device plugin advertises (v0.13+ on Tegra, with the
#: NVIDIA Container Toolkit >= 1.11): it puts the Jetson GPU's nodes into the container.
CUDA_RESOURCE = "nvidia.com/gpu"


def check_gpu(bp: BoardPlan) -> None:
    """A Vulkan plan is refused: no standard device plugin hands a pod a Mali or v3d GPU,
    and a pod without the device would only fail at start (serve's backend check)."""
    engine = bp.plan.engine
    if engine.backend == "vulkan":
        raise RefusedError(
            f"board {bp.slug}: the plan offloads {engine.n_gpu_layers} layers to Vulkan "
            f"({engine.device or 'the default device'}), which the Kubernetes manifests "
            "cannot grant a pod",
            facts={"backend": engine.backend, "n_gpu_layers": engine.n_gpu_layers},
            hint="plan this board kind with --gpu none for Kubernetes, or deploy it with "
            "`slmguard apply` (the unit's DeviceAllow= grants the GPU's nodes)",
        )


def _resources(bp: BoardPlan, nodes: NodeNumbers) -> Commented:
    """Guaranteed QoS: the memory and CPU requests equal to the limits, with their reasons;
    a CUDA plan's GPU through NVIDIA's device plugin."""
    plan = bp.plan
    mem, cpus = quantity(nodes.pod_memory_bytes), str(nodes.pod_cpus)
    amounts: dict[str, str] = {"memory": mem, "cpu": cpus}
    gpu_why = ""
    if plan.engine.backend == "cuda":
        amounts[CUDA_RESOURCE] = "1"
        gpu_why = (
            f"\n{CUDA_RESOURCE} = the Jetson GPU the plan offloads {plan.engine.n_gpu_layers} "
            "layers to, from NVIDIA's device plugin (v0.13+ on Tegra); its nvmap buffers "
            f"({plan.limits.device_bytes} bytes planned) are outside the pod's memory limit."
        )
    pinned = plan.cpu_affinity
    cpu_why = (
        f"the plan's {len(pinned)} pinned cores (cpuManagerPolicy static makes them exclusive)"
        if pinned and len(pinned) < len(plan.board.cpus)
        else f"all {len(plan.board.cpus)} CPUs but one (left to the OS, k3s and the business zone)"
    )
    return Commented(
        {"requests": dict(amounts), "limits": dict(amounts)},
        f"Guaranteed QoS: request == limit. memory = the plan's MemoryMax "
        f"({plan.limits.memory_max_bytes} bytes); the governor sheds at MemoryHigh "
        f"({plan.limits.memory_high_bytes} bytes, from the plan).\ncpu = {cpu_why}.{gpu_why}",
    )


def _probes(t: Timing) -> dict[str, object]:
    """The startup, readiness and liveness probes of the server container."""
    startup_failures = -(-t.startup_allowance_s // STARTUP_PERIOD_S)
    return {
        "startupProbe": Commented(
            _probe_http(STARTUP_PERIOD_S, 5, startup_failures),
            f"{t.why_startup}: {startup_failures} x {STARTUP_PERIOD_S} s.",
        ),
        "readinessProbe": Commented(
            _probe_http(5, 3, 2),
            "Ready = the engine serves: /health answers 200 only while ready or degraded "
            "(503 while loading,\nrestarting, stalled or parked by the governor).",
        ),
        "livenessProbe": Commented(
            {
                "exec": {
                    "command": [
                        CONTAINER_PYTHON,
                        "-m",
                        "slmguard.deploy.probe",
                        "--url",
                        f"http://127.0.0.1:{PORT}/health",
                        "--timeout-s",
                        "4",
                    ]
                },
                "periodSeconds": LIVENESS_PERIOD_S,
                "timeoutSeconds": 5,
                "failureThreshold": LIVENESS_FAILURES,
            },
            "Alive unless the front cannot recover: no answer (hung), engine failed for good, "
            "or a stall\nit did not replace; a killed, stalled or parked engine is the front's "
            f"to restart. {LIVENESS_FAILURES} x {LIVENESS_PERIOD_S} s = the unit's "
            "WatchdogSec=30.",
        ),
    }


def _projector_args(bp: BoardPlan) -> list[str]:
    """``--mmproj FILE`` with a vision projector, as the unit passes it (serve checks the
    file against the plan's size and sha256)."""
    v = bp.model.projector
    return [] if v is None else ["--mmproj", v.dest]


def _container(bp: BoardPlan, opts: K8sOptions, nodes: NodeNumbers, t: Timing) -> dict[str, object]:
    """The server container: ``slmguard serve --plan``, its resources, probes and mounts."""
    return {
        "name": "server",
        "image": opts.image,
        "imagePullPolicy": "IfNotPresent",
        # The image's ENTRYPOINT is `slmguard serve` (container/Containerfile).
        "args": [
            "--plan",
            PLAN_PATH,
            "--host",
            "0.0.0.0",
            "--port",
            str(PORT),
            "--api-key-file",
            f"{SECRET_DIR}/{API_KEY}",
            "--admin-token-file",
            ADMIN_TOKEN_FILE,
            *_projector_args(bp),
        ],
        "env": _env(bp, nodes.pod_cpus, t.engine_load_timeout_s),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": _resources(bp, nodes),
        **_probes(t),
        "securityContext": _CONTAINER_SECURITY,
        "volumeMounts": [
            {"name": "plan", "mountPath": "/etc/slmguard", "readOnly": True},
            *_model_mounts(bp, opts),
            {"name": "secrets", "mountPath": SECRET_DIR, "readOnly": True},
            {"name": "state", "mountPath": STATE_DIR},
            {"name": "run", "mountPath": RUNTIME_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def _model_mounts(bp: BoardPlan, opts: K8sOptions) -> list[object]:
    """The server's models: the node's (or the claim's) model directory; with a mirror,
    each file of the plan from the cache (``<sha256>/<name>``) at its name in
    :data:`MODEL_DIR`, where the deployed plan names it (file mounts side by side: a
    mount inside a read-only one could not be made)."""
    if not opts.model_mirror:
        return [{"name": "models", "mountPath": MODEL_DIR, "readOnly": True}]
    mounts: dict[str, object] = {}
    for f in bp.files:
        name = model_file_name(f)
        mounts.setdefault(
            f.dest,
            {
                "name": "models",
                "mountPath": f.dest,
                "subPath": f"{f.sha256}/{name}",
                "readOnly": True,
            },
        )
    return list(mounts.values())


def _file_step(bp: BoardPlan, f: ModelSource) -> str:
    """The init container's name for one file of the plan (a fixed DNS label)."""
    if f is bp.model:
        return "model"
    if f is bp.model.projector:
        return "projector"
    return f"model-{bp.others.index(f) + 2}"


def _download_step(
    bp: BoardPlan, f: ModelSource, mirror: str, image: str, resources: dict[str, str]
) -> Commented:
    """The init container that puts one file of the plan in the node's cache by sha256."""
    return Commented(
        {
            "name": _file_step(bp, f),
            "image": image,
            "imagePullPolicy": "IfNotPresent",
            "command": [
                CONTAINER_PYTHON,
                "-m",
                PODINIT,
                "model",
                "--url",
                model_url(mirror, f),
                "--sha256",
                f.sha256,
                "--size",
                str(f.size_bytes),
                "--cache",
                MODEL_CACHE,
                "--name",
                model_file_name(f),
            ],
            "resources": {"requests": resources, "limits": resources},
            "securityContext": _CONTAINER_SECURITY,
            "volumeMounts": [{"name": "models", "mountPath": MODEL_CACHE}],
        },
        f"The {f.kind} {model_file_name(f)} ({f.size_bytes} bytes) in the node's cache by "
        "sha256: downloaded once\nfrom the mirror (resumed, retried, checked as it arrives), "
        f"kept for every later pod of this {f.kind}.",
    )


def _init_containers(bp: BoardPlan, opts: K8sOptions) -> list[object]:
    """Before the server: the pod's own admin token, and each file of the plan when a
    mirror has it."""
    resources = {"memory": "128Mi", "cpu": "1"}
    steps: list[object] = [
        Commented(
            {
                "name": "admin-token",
                "image": opts.image,
                "imagePullPolicy": "IfNotPresent",
                "command": [CONTAINER_PYTHON, "-m", PODINIT, "admin-token", ADMIN_TOKEN_FILE],
                "resources": {"requests": resources, "limits": resources},
                "securityContext": _CONTAINER_SECURITY,
                "volumeMounts": [{"name": "run", "mountPath": RUNTIME_DIR}],
            },
            "This pod's own admin token (never shared, never in a Secret): kubectl exec ... "
            f"cat {ADMIN_TOKEN_FILE}.",
        )
    ]
    if opts.model_mirror:
        seen: set[tuple[str, str]] = set()
        for f in bp.files:  # each file of the cache once (the same bytes, the same name)
            if (f.sha256, model_file_name(f)) not in seen:
                seen.add((f.sha256, model_file_name(f)))
                steps.append(_download_step(bp, f, opts.model_mirror, opts.image, resources))
    return steps


def _volumes(bp: BoardPlan, opts: K8sOptions, plan_text: str) -> list[object]:
    """The pod's volumes: the plan, the model, the secrets and the writable scratch."""
    return [
        {"name": "plan", "configMap": {"name": plan_configmap_name(bp, plan_text)}},
        Commented(
            _model_volume(bp, opts),
            "The model (and every other file of the plan); serve --plan checks each one's size "
            "and sha256\nagainst the plan at start (exit 65 if not).",
        ),
        {
            "name": "secrets",
            "secret": {
                "secretName": opts.secret,
                "defaultMode": 0o440,
                "items": [{"key": API_KEY, "path": API_KEY}],
            },
        },
        Commented(
            {"name": "state", "emptyDir": {"sizeLimit": "256Mi"}},
            "Sessions, stall evidence and the model's digest cache (disk, not memory).",
        ),
        Commented(
            {"name": "run", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
            "The engine's unix socket and per-start key, and the pod's admin token.",
        ),
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]


def _placement(bp: BoardPlan, canary: bool) -> dict[str, object]:
    """The nodes of the kind: its canary node(s), or the others."""
    node_selector: dict[str, str] = {BOARD_LABEL: bp.slug}
    if bp.arch:
        node_selector["kubernetes.io/arch"] = bp.arch
    if canary:
        node_selector[CANARY_LABEL] = "true"
        return {"nodeSelector": node_selector}
    others = {"key": CANARY_LABEL, "operator": "NotIn", "values": ["true"]}
    return {
        "nodeSelector": node_selector,
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [others]}]
                }
            }
        },
    }


def daemonset_name(bp: BoardPlan, canary: bool = False) -> str:
    return _name(bp, "canary" if canary else "")


def daemonset(bp: BoardPlan, opts: K8sOptions, plan_text: str, canary: bool = False) -> str:
    """A DaemonSet of one board kind: its canary node(s), or the others; its pod's identity
    and container. (See the module docstring for every number.)"""
    plan, nodes, t = bp.plan, node_numbers(bp), timing(bp.plan)
    name = daemonset_name(bp, canary)
    labels = {**_labels(bp), "app.kubernetes.io/instance": name}
    pod = {
        "metadata": {
            "labels": labels,
            "annotations": {
                "slmguard.io/plan-sha256": hashlib.sha256(plan_text.encode()).hexdigest(),
                "slmguard.io/board-name": plan.board.name,
                "slmguard.io/model": plan.model.name,
                "slmguard.io/model-sha256": bp.model.sha256,
            },
        },
        "spec": {
            **_placement(bp, canary),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": Commented(t.stop_grace_s, t.why_stop + "."),
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": CONTAINER_UID,
                "runAsGroup": CONTAINER_UID,
                "fsGroup": CONTAINER_UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "initContainers": _init_containers(bp, opts),
            "containers": [_container(bp, opts, nodes, t)],
            "volumes": _volumes(bp, opts, plan_text),
        },
    }
    unavailable = 1 if canary else MAX_UNAVAILABLE
    doc = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": opts.namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/instance": name}},
            "minReadySeconds": Commented(t.min_ready_s, t.why_min_ready + "."),
            "updateStrategy": Commented(
                {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxUnavailable": unavailable, "maxSurge": 0},
                },
                "The old pod stops before the new one starts: two models would not fit a board.",
            ),
            "template": pod,
        },
    }
    where = (
        f"the {bp.slug} canary node(s) (labels {BOARD_LABEL}={bp.slug}, {CANARY_LABEL}=true): "
        "rollout.sh applies it first"
        if canary
        else f"every other {bp.slug} board (label {BOARD_LABEL}={bp.slug}): rollout.sh "
        "applies it once the canary is available"
    )
    header = (
        f"The model server on {where}.\n"
        f"Node settings: kubelet-config.yaml ({K3S_KUBELET_CONFIG}) and k3s-config.yaml."
    )
    return yamltext.dump(doc, header)


def kustomization(bps: tuple[BoardPlan, ...]) -> str:
    resources = ["namespace.yaml", "service.yaml", "networkpolicy.yaml"]
    for bp in bps:
        resources += [f"{bp.slug}/plan-configmap.yaml"]
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": resources,
    }
    return yamltext.dump(
        doc,
        "kubectl apply -k DIR: everything but the DaemonSets, which rollout.sh applies canary "
        "first\n(the kubelet files go to the nodes instead).",
    )


def rollout_script(bps: tuple[BoardPlan, ...], opts: K8sOptions) -> str:
    """``rollout.sh``: the base, then per kind the canary, gated, then the rest, gated.

    Every word in it is a validated DNS label or a fixed string (no plan text)."""
    kinds = " ".join(bp.slug for bp in bps)
    waits = max(timing(bp.plan).startup_allowance_s + timing(bp.plan).min_ready_s for bp in bps)
    ns = opts.namespace
    return f"""#!/bin/sh
# Rendered by slmguard {__version__} (render --target k8s): roll the plans out, canary first.
# For each board kind: its canary DaemonSet (the node(s) labelled {CANARY_LABEL}=true),
# waited on until its pod is available (ready for minReadySeconds), then the rest, at
# most {MAX_UNAVAILABLE} of the kind's nodes at a time, each new pod held ready as long.
# A canary that does not become available stops here: nothing else is touched. Undo:
#   kubectl -n {ns} rollout undo daemonset/slmguard-KIND-canary (and daemonset/slmguard-KIND)
set -eu
cd "$(dirname "$0")"
NS={ns}
KINDS="{kinds}"
CANARY_TIMEOUT=${{CANARY_TIMEOUT:-{2 * waits}s}}
kubectl apply -k .
for kind in $KINDS; do
    n=$(kubectl get nodes -l "{BOARD_LABEL}=$kind,{CANARY_LABEL}=true" -o name | wc -l)
    if [ "$n" -lt 1 ]; then
        echo "no canary node of kind $kind: kubectl label node NODE {CANARY_LABEL}=true" >&2
        exit 1
    fi
    kubectl apply -f "$kind/daemonset-canary.yaml"
    kubectl -n "$NS" rollout status "daemonset/slmguard-$kind-canary" --timeout="$CANARY_TIMEOUT"
done
for kind in $KINDS; do
    kubectl apply -f "$kind/daemonset.yaml"
    kubectl -n "$NS" rollout status "daemonset/slmguard-$kind" --timeout=0
done
"""


def _file(path: str, text: str, why: str) -> RenderedFile:
    return RenderedFile(path, content=text.encode(), why=why)


def render_manifests(bps: tuple[BoardPlan, ...], opts: K8sOptions) -> tuple[RenderedFile, ...]:
    """Every file of ``render --target k8s``, at paths relative to the output directory."""
    validate_options(opts)
    ns = opts.namespace
    files = [
        _file("/namespace.yaml", namespace(opts), "the namespace"),
        _file("/service.yaml", service(opts), "the Service (node-local traffic)"),
        _file("/networkpolicy.yaml", network_policy(opts), "who may reach the servers"),
        _file("/kustomization.yaml", kustomization(bps), "kubectl apply -k"),
        _file(
            "/monitoring/servicemonitor.yaml",
            monitoring.service_monitor(ns, opts.secret, API_KEY),
            "Prometheus scrapes /metrics",
        ),
        _file("/monitoring/prometheusrule.yaml", monitoring.prometheus_rule(ns), "the alerts"),
        _file(
            "/monitoring/grafana-dashboard.yaml",
            monitoring.dashboard_configmap(ns),
            "the dashboard for Grafana's sidecar",
        ),
        _file("/monitoring/slmguard-dashboard.json", monitoring.dashboard(ns), "the dashboard"),
        _file("/monitoring/kustomization.yaml", monitoring.kustomization(), "kubectl apply -k"),
    ]
    for bp in bps:
        check_gpu(bp)
        plan_text = deployed_plan_text(bp)
        files += [
            _file(f"/{bp.slug}/plan-configmap.yaml", plan_configmap(bp, opts), "the plan"),
            _file(
                f"/{bp.slug}/daemonset-canary.yaml",
                daemonset(bp, opts, plan_text, canary=True),
                "the server on the canary node(s)",
            ),
            _file(
                f"/{bp.slug}/daemonset.yaml",
                daemonset(bp, opts, plan_text),
                "the server on the other nodes",
            ),
            _file(f"/{bp.slug}/kubelet-config.yaml", kubelet_config(bp), "node: kubelet"),
            _file(f"/{bp.slug}/k3s-config.yaml", k3s_dropin(bp), "node: k3s drop-in"),
        ]
    files.append(
        RenderedFile(
            "/rollout.sh",
            content=rollout_script(bps, opts).encode(),
            mode=0o755,
            why="the rollout: canary first, gated",
        )
    )
    return tuple(files)

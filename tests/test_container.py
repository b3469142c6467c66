"""``container/Containerfile``: its invariants, and that the k8s manifests run it as built.

No image is built here (no registry to pull the base from): the file is parsed
and held to the rules the manifests rely on: a non-root numeric USER equal to
the pod's runAsUser, a base pinned to an exact tag or digest (never
``latest``), multi-stage with no model inside, ``slmguard serve`` as the
ENTRYPOINT with the plan as its default argument, and the paths the DaemonSet
names. Each rule is shown to catch a file that breaks it.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from slmguard.deploy.fleet import image as img
from slmguard.deploy.fleet import k8s

REPO = Path(__file__).resolve().parents[1]
CONTAINERFILE = REPO / "container" / "Containerfile"
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Instruction:
    word: str
    args: str


def parse(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, args = full.partition(" ")
            out.append(Instruction(word.upper(), args.strip()))
    return out


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"not exec form: {args}"
    return [str(v) for v in value]


def problems(text: str) -> list[str]:
    """Our rules for the Containerfile (empty: it complies)."""
    found = []
    ins = parse(text)
    args = {
        i.args.split("=", 1)[0]: i.args.split("=", 1)[1]
        for i in ins
        if i.word == "ARG" and "=" in i.args
    }
    froms = [i.args.split()[0] for i in ins if i.word == "FROM"]
    stages = {i.args.split()[-1] for i in ins if i.word == "FROM" and " AS " in i.args.upper()}
    if len(froms) < 2:
        found.append("not multi-stage")
    for ref in froms:
        if ref in stages:
            continue
        image = args.get(ref[2:-1], "") if ref.startswith("${") else ref
        tag = image.rsplit("/", 1)[-1].split("@")[0].partition(":")[2]
        if "@sha256:" not in image and (not tag or tag == "latest" or not re.search(r"\d", tag)):
            found.append(f"base {image or ref} is not pinned to an exact tag or digest")
    users = [i.args for i in ins if i.word == "USER"]
    if not users:
        found.append("no USER: runs as root")
    else:
        uid = users[-1].split(":")[0]
        if not uid.isdigit() or int(uid) == 0:
            found.append(f"USER {users[-1]} is not a numeric non-root user")
        elif int(uid) != img.CONTAINER_UID:
            found.append(f"USER {uid} is not the pod's runAsUser {img.CONTAINER_UID}")
    entry = [i.args for i in ins if i.word == "ENTRYPOINT"]
    if not entry or _exec_form(entry[-1]) != [f"{img.CONTAINER_VENV}/bin/slmguard", "serve"]:
        found.append(f"ENTRYPOINT is not {img.CONTAINER_VENV}/bin/slmguard serve")
    cmd = [i.args for i in ins if i.word == "CMD"]
    if not cmd or _exec_form(cmd[-1])[:1] != ["--plan"]:
        found.append("CMD does not start with --plan")
    env = " ".join(i.args for i in ins if i.word == "ENV")
    if f"SLMGUARD_LLAMA_SERVER={img.CONTAINER_ENGINE}" not in env:
        found.append(f"the engine is not at {img.CONTAINER_ENGINE}")
    if any(
        re.search(r"\.gguf\b|model prepare", i.args)
        for i in ins
        if i.word in ("COPY", "ADD", "RUN")
    ):
        found.append("a model is baked in")
    if any(i.word == "ADD" and "://" in i.args for i in ins):
        found.append("ADD from a URL")
    health = [i.args for i in ins if i.word == "HEALTHCHECK"]
    probe = [img.CONTAINER_PYTHON, "-m", "slmguard.deploy.probe"]
    if not health or "CMD [" not in health[-1]:
        found.append("no HEALTHCHECK in exec form")
    elif _exec_form(health[-1].split("CMD", 1)[1].strip())[:3] != probe:
        found.append("the HEALTHCHECK is not the pods' liveness probe")
    return found


def test_the_containerfile_complies() -> None:
    assert problems(CONTAINERFILE.read_text()) == []


@pytest.mark.parametrize(
    ("old", "new", "says"),
    [
        ("USER 65532:65532", "USER root", "numeric non-root"),
        ("USER 65532:65532", "USER 1000", "runAsUser"),
        ("USER 65532:65532\n", "", "runs as root"),
        ("debian:12.11-slim", "debian:latest", "not pinned"),
        ("debian:12.11-slim", "debian:bookworm-slim", "not pinned"),
        ("debian:12.11-slim", "debian", "not pinned"),
        ('"serve"]', '"top"]', "ENTRYPOINT"),
        ('CMD ["--plan", "/etc/slmguard/plan.json"]', 'CMD ["--port", "1"]', "CMD"),
        ("SLMGUARD_LLAMA_SERVER=/opt", "SLMGUARD_LLAMA_SERVER=/usr", "the engine"),
        ("COPY wheels/ /tmp/wheels/", "COPY wheels/ m.gguf /tmp/wheels/", "model is baked"),
        ("HEALTHCHECK --interval", "# HEALTHCHECK --interval", "no HEALTHCHECK"),
        ('"slmguard.deploy.probe"', '"http.server"', "liveness probe"),
    ],
)
def test_the_rules_catch_what_they_look_for(old: str, new: str, says: str) -> None:
    text = CONTAINERFILE.read_text()
    assert old in text
    assert any(says in p for p in problems(text.replace(old, new))), problems(
        text.replace(old, new)
    )


def test_a_digest_pins_too() -> None:
    text = CONTAINERFILE.read_text().replace("debian:12.11-slim", "debian@sha256:" + "ab" * 32)
    assert problems(text) == []


def test_the_daemonset_runs_the_images_entrypoint_with_the_plan() -> None:
    """ENTRYPOINT ``slmguard serve`` + the pod's args = ``slmguard serve --plan ...``."""
    import yaml

    from fleettrees import board_plan

    bp = board_plan("rk3588-4g")
    files = {
        f.path: f
        for f in k8s.render_manifests(
            (bp,), k8s.K8sOptions(image="registry.example/slmguard:0.1.0@sha256:" + "0" * 64)
        )
    }
    (ds,) = yaml.safe_load_all(files[f"/{bp.slug}/daemonset.yaml"].content or b"")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert "command" not in c  # the image's ENTRYPOINT
    assert c["args"][:2] == ["--plan", "/etc/slmguard/plan.json"]
    volumes = {m["mountPath"] for m in c["volumeMounts"]}
    # what the image writes at run time is mounted (a read-only root file system)
    assert {"/var/lib/slmguard", "/run/slmguard", "/tmp"} <= volumes
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SLMGUARD_LLAMA_SERVER"] == img.CONTAINER_ENGINE


def test_the_context_leaves_the_model_out_and_pins_the_rest() -> None:
    from container import context

    reqs = context.serve_requirements(REPO / "pyproject.toml")
    names = [re.split(r"[=<>]", r)[0] for r in reqs]
    assert context.MODEL_PACKAGE not in names and "fastapi" in names and "uvicorn" in names
    assert all("==" in r for r in reqs)
    from systest import wheels

    tags = wheels.guest_platforms("aarch64")
    assert tags[0] == "manylinux_2_36_aarch64" and all(t.endswith("aarch64") for t in tags)
    assert "manylinux1_aarch64" not in tags  # no such tag exists for aarch64

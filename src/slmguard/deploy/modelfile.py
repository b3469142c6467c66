"""The model the deployment serves: which file, checked against the plan, and where it goes.

A plan made with ``slmguard plan --model FILE`` names its GGUF (absolute path,
size, sha256); a preset plan names none (``path`` null), and ``render`` and
``apply`` need ``--model FILE`` for it (else 78, saying so). Either way the
file is checked against the plan before anything is written:

- a file plan: the file (``--model``, or the plan's path) must have the
  plan's size and, when the plan records one, its sha256 (65 otherwise);
- a preset plan: the file's GGUF header must be the planned architecture and
  layer count, and its size must not exceed the planned weights by more than
  2% (the budget counts them) (78 otherwise).

Where it goes: ``apply`` installs it as ``/var/lib/slmguard-models/<name>``
(the name reduced to ``[A-Za-z0-9._+-]``), root's, readable by everyone
(0644): outside ``/home``, ``/root`` and ``/run/user`` (``ProtectHome=yes``
hides them), outside the services' ``StateDirectory=`` ``/var/lib/slmguard``
(systemd chowns that recursively to the transient service user at each start,
which would hand the service user the model, or, through a hard link, the
operator's own file), and read-only to the service like all of ``/var``
under ``ProtectSystem=strict``. The ``/etc/slmguard/plan.json`` apply writes
names that path, with the size and sha256, and ``serve --plan`` serves it.

A hard link is used when the source is on the same file system, a regular
file owned by root, readable by others and writable by nobody else, and not
inside the state directory; otherwise the file is copied (atomically, with
progress, and hashed while copied). Either way the manifest records the path
as created by apply, so ``rollback`` removes it (never the source).

``_verify_planned_model`` and ``_model_for_preset_plan`` stand in for
``slmguard.plan.model.verify_planned_model(plan) -> Path`` and
``model_for_preset_plan(plan, model_file) -> ModelSpec`` (the plan side's,
not merged yet) with the same signatures: replace them by imports on merge.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path

from slmguard.default_model import sha256_file
from slmguard.deploy import escape
from slmguard.deploy.rootpath import confine
from slmguard.errors import ModelError, ModelNotFoundError, RefusedError
from slmguard.plan.schema import ModelSpec, Plan

#: Where apply installs the model (see the module docstring for why here).
MODEL_DIR = "/var/lib/slmguard-models"
#: The services' StateDirectory=, which systemd chowns to the service user.
STATE_DIRS = ("/var/lib/slmguard", "/var/lib/private/slmguard")
#: The first bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
#: How much bigger than planned a preset's file may be (published sizes vary a little).
PRESET_SIZE_SLACK = 0.02


@dataclass(frozen=True)
class ModelSource:
    """The GGUF apply installs, and the model spec the deployed plan records."""

    source: Path  # the file as it is now (absolute)
    spec: ModelSpec  # path = the installed destination, file_bytes, sha256

    @property
    def dest(self) -> str:
        assert self.spec.path is not None
        return self.spec.path

    @property
    def size_bytes(self) -> int:
        return self.spec.file_bytes

    @property
    def sha256(self) -> str:
        assert self.spec.sha256 is not None
        return self.spec.sha256


def _regular_file(path: Path) -> os.stat_result:
    """stat of a GGUF file: 66 when missing, 65 when not a regular file or not GGUF.

    Checked before anything reads it (a FIFO would hang) and before apply
    copies it somewhere readable by everyone: a hostile plan naming
    ``/etc/shadow`` with its size must not get it published.
    """
    try:
        st = path.stat()
    except FileNotFoundError as err:
        raise ModelNotFoundError(path, hint="give the GGUF to deploy with --model FILE") from err
    except OSError as err:
        raise ModelError(path, f"cannot stat: {err.strerror or err}") from err
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(path, "is not a regular file")
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as err:
        raise ModelError(path, f"cannot read: {err.strerror or err}") from err
    if magic != GGUF_MAGIC:
        raise ModelError(path, "is not a GGUF file (no GGUF magic)")
    return st


def _verify_planned_model(plan: Plan) -> Path:
    """The plan's model file, checked: size, and sha256 when the plan records one (65)."""
    spec = plan.model
    if spec.path is None:
        raise RefusedError("plan.model.path: the plan names no model file")
    path = Path(spec.path)
    st = _regular_file(path)
    if st.st_size != spec.file_bytes:
        raise ModelError(
            path,
            f"is {st.st_size} bytes; the plan was made for {spec.file_bytes} bytes",
            hint="give the file the plan was made from with --model, or plan again",
        )
    if spec.sha256 is not None and sha256_file(path) != spec.sha256:
        raise ModelError(
            path,
            f"sha256 differs from the plan's {spec.sha256}",
            hint="give the file the plan was made from with --model, or plan again",
        )
    return path


def _model_for_preset_plan(plan: Plan, model_file: Path) -> ModelSpec:
    """The ModelSpec of ``model_file`` for a preset plan, after checking it fits the plan."""
    from slmguard.plan.modelfacts import read_model_facts

    spec = plan.model
    path = Path(os.path.abspath(model_file))
    _regular_file(path)
    facts = read_model_facts(path)
    if (facts.arch, facts.n_layer) != (spec.arch, spec.n_layer):
        raise RefusedError(
            f"{path} is a {facts.arch} model with {facts.n_layer} layers; the plan is for "
            f"preset {spec.preset} ({spec.arch}, {spec.n_layer} layers)",
            facts={"path": str(path), "arch": facts.arch, "n_layer": facts.n_layer},
            hint="give the GGUF of the planned model, or plan with --model FILE",
        )
    if facts.file_bytes > spec.file_bytes * (1 + PRESET_SIZE_SLACK):
        raise RefusedError(
            f"{path} is {facts.file_bytes} bytes, more than the {spec.file_bytes} bytes of "
            f"weights the plan for preset {spec.preset} budgets",
            facts={"path": str(path), "file_bytes": facts.file_bytes},
            hint="plan with --model FILE to budget this file",
        )
    return replace(
        spec,
        path=str(path),
        file_bytes=facts.file_bytes,
        n_ctx_train=facts.n_ctx_train,
        sha256=sha256_file(path),
    )


def _installed_dest(name: str) -> str:
    return f"{MODEL_DIR}/{escape.file_name(name)}"


def planned_model(plan: Plan, model_file: Path | None, root: Path | None = None) -> ModelSource:
    """The model to deploy for ``plan``: ``model_file`` or the plan's, checked (see above).

    ``root``: the target, when its installed plan (whose path is already under
    :data:`MODEL_DIR`) is applied again: the file is then read under the root.
    """
    spec = plan.model
    if spec.path is None and model_file is None:
        raise RefusedError(
            f"the plan is for the preset {spec.preset or spec.name!r} and names no model "
            "file: give the GGUF to deploy with --model FILE",
            facts={"preset": spec.preset},
            hint="or plan with --model FILE, which records the file's path, size and sha256",
        )
    if spec.path is None:
        assert model_file is not None
        checked = _model_for_preset_plan(plan, model_file)
        source = Path(str(checked.path))
    else:
        given = model_file
        if given is None and root is not None and spec.path.startswith(MODEL_DIR + "/"):
            # The installed plan of an earlier apply: its model is the installed file.
            given = confine(root, spec.path, follow=True, where="plan.model.path")
        path = Path(os.path.abspath(given if given is not None else spec.path))
        source = _verify_planned_model(replace(plan, model=replace(spec, path=str(path))))
        checked = replace(spec, path=str(source), sha256=spec.sha256 or sha256_file(source))
    dest = _installed_dest(Path(str(checked.path)).name)
    return ModelSource(source, replace(checked, path=dest))


def deployed_plan(plan: Plan, model: ModelSource | None) -> Plan:
    """The plan as apply installs it: its model is the installed file (path, size, sha256)."""
    return plan if model is None else replace(plan, model=model.spec)


def can_link(source: Path) -> bool:
    """Whether the installed model may be a hard link of ``source`` (see the module docstring)."""
    try:
        st = source.lstat()
    except OSError:
        return False
    real = os.path.realpath(source)
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == 0
        and st.st_mode & 0o004 != 0
        and st.st_mode & 0o022 == 0
        and not any(real == d or real.startswith(d + "/") for d in STATE_DIRS)
    )

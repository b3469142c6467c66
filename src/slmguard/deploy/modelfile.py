"""The model the deployment serves: which file, checked against the plan, and where it goes.

Owns the model (and a plan's vision projector) as ``render`` and ``apply`` see it: the
file (the plan's, or ``--model FILE``, required for a preset plan: 78 otherwise),
checked before anything is written with :mod:`slmguard.plan.model`'s checks (the ones
``serve`` makes: size and sha256 for a file plan, header and size for a preset), run
without its digest cache; and where it is installed, :data:`MODEL_DIR`
(``/var/lib/slmguard-models/<name>``, 0644, root's), as a hard link when the source is
safe to link (same file system, root's, writable by nobody else) or else an atomic,
hashed copy. ``docs/deploy.md`` (The model) says why that directory and when a link.

It must not write outside the target root (the manifest records the installed path as
created by apply, so ``rollback`` removes it, never the source) nor parse GGUF itself.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

from slmguard.deploy import escape
from slmguard.deploy.rootpath import confine
from slmguard.errors import ModelError, ModelNotFoundError, RefusedError, UsageError
from slmguard.plan.model import ProgressFn, model_for_plan, projector_for_plan
from slmguard.plan.schema import ModelSpec, Plan, ProjectorSpec

if TYPE_CHECKING:
    from slmguard.deploy.digests import Digests

#: Where apply installs the model (see the module docstring for why here).
MODEL_DIR = "/var/lib/slmguard-models"
#: The services' StateDirectory=, which systemd chowns to the service user.
STATE_DIRS = ("/var/lib/slmguard", "/var/lib/private/slmguard")
#: The first bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelSource:
    """A GGUF apply installs, and the spec the deployed plan records for it: the model's
    (:class:`ModelSpec`) with the plan's vision projector beside it (``projector``, its
    spec a :class:`ProjectorSpec`), or None."""

    source: Path  # the file as it is now (absolute)
    spec: ModelSpec | ProjectorSpec  # path = the installed destination, file_bytes, sha256
    projector: ModelSource | None = None

    @property
    def kind(self) -> str:
        """What the file is, as messages name it: ``model`` or ``projector``."""
        return "projector" if isinstance(self.spec, ProjectorSpec) else "model"

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


def _regular_file(
    path: Path, missing: str = "give the GGUF to deploy with --model FILE"
) -> os.stat_result:
    """stat of a GGUF file: 66 when missing, 65 when not a regular file or not GGUF.

    Checked before anything reads it (a FIFO would hang) and before apply
    copies it somewhere readable by everyone: a hostile plan naming
    ``/etc/shadow`` with its size must not get it published.
    """
    try:
        st = path.stat()
    except FileNotFoundError as err:
        raise ModelNotFoundError(path, hint=missing) from err
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


def _installed_dest(name: str) -> str:
    return f"{MODEL_DIR}/{escape.file_name(name)}"


def _stamped(
    spec: ModelSpec | ProjectorSpec, path: Path, digests: Digests | None
) -> ModelSpec | ProjectorSpec | None:
    """The file plan's ``spec`` for ``path`` when apply's stamp vouches for it (nothing read)."""
    if digests is None or spec.path is None or spec.sha256 is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size != spec.file_bytes:
        return None
    if digests.trusted(path) != spec.sha256:
        return None
    return replace(spec, path=os.path.realpath(path))


def planned_model(
    plan: Plan,
    model_file: Path | None,
    root: Path | None = None,
    progress: ProgressFn | None = None,
    digests: Digests | None = None,
    mmproj: Path | None = None,
) -> ModelSource:
    """The model to deploy for ``plan``: ``model_file`` or the plan's, checked (see above).

    ``root``: the target, when its installed plan (whose path is already under
    :data:`MODEL_DIR`) is applied again: the file is then read under the root.
    ``digests``: apply's stamps of that root (:mod:`slmguard.deploy.digests`):
    a file of a file plan whose stamp still matches is not read at all.
    """
    spec = plan.model
    if spec.path is None and model_file is None:
        raise RefusedError(
            f"the plan is for the preset {spec.preset or spec.name!r} and names no model "
            "file: give the GGUF to deploy with --model FILE",
            facts={"preset": spec.preset},
            hint="or plan with --model FILE, which records the file's path, size and sha256",
        )
    given = _installed(model_file, spec.path, root, "plan.model.path")
    path = Path(os.path.abspath(given if given is not None else str(spec.path)))
    checked = _stamped(spec, path, digests)
    if checked is None:
        # Before anything is hashed or published: a regular file holding a GGUF (a hostile
        # plan naming /etc/shadow with its size must not get it copied out).
        _regular_file(path)
        checked = model_for_plan(plan, given, progress=progress, cache=False)
        if digests is not None and checked.sha256 is not None:
            digests.remember(Path(str(checked.path)), checked.sha256)
    source = Path(str(checked.path))
    dest = _installed_dest(Path(str(checked.path)).name)
    projector = planned_projector(plan, root, progress, digests, mmproj)
    if projector is not None and projector.dest == dest:
        raise RefusedError(
            f"the model and the projector would both be installed as {dest}",
            facts={"path": dest},
            hint="rename one of the files and plan again",
        )
    return ModelSource(source, replace(checked, path=dest), projector)


def _installed(given: Path | None, path: str | None, root: Path | None, where: str) -> Path | None:
    """The file to check: ``given``, or under ``root`` the installed file an earlier
    apply's plan names (its path under :data:`MODEL_DIR`), or None (the plan's own)."""
    if given is None and root is not None and str(path).startswith(MODEL_DIR + "/"):
        return confine(root, str(path), follow=True, where=where)
    return given


def planned_projector(
    plan: Plan,
    root: Path | None = None,
    progress: ProgressFn | None = None,
    digests: Digests | None = None,
    mmproj: Path | None = None,
) -> ModelSource | None:
    """The plan's vision projector to deploy, checked like the model (size and sha256:
    66/65): ``mmproj`` (a copy elsewhere) or the plan's file; None for a plan without one
    (``mmproj`` given for it: 78)."""
    spec = plan.projector
    if spec is None:
        if mmproj is not None:
            projector_for_plan(plan, mmproj)  # ConfigError (78): no images were budgeted
        return None
    if spec.sha256 is None:
        raise RefusedError(
            "plan.projector names no sha256: apply installs only a projector it can check",
            facts={"path": spec.path},
            hint="plan again with --mmproj FILE (it records the file's sha256)",
        )
    given = _installed(mmproj, spec.path, root, "plan.projector.path")
    path = Path(os.path.abspath(given if given is not None else spec.path))
    checked = _stamped(spec, path, digests)
    if checked is None:
        _regular_file(path, "put the projector the plan names back, or plan again with --mmproj")
        checked = projector_for_plan(plan, given, progress=progress, cache=False)
        assert checked is not None
        if digests is not None and checked.sha256 is not None:
            digests.remember(Path(checked.path), checked.sha256)
    source = Path(str(checked.path))
    return ModelSource(source, replace(checked, path=_installed_dest(source.name)))


def board_models(
    plan: Plan,
    root: Path | None = None,
    progress: ProgressFn | None = None,
    digests: Digests | None = None,
    given: Sequence[Path] = (),
) -> tuple[ModelSource, ...]:
    """The board's other models to deploy (``plan.models``, issue 39), each its planned
    file (or ``given[i]``, a copy elsewhere: ``--board-model``, one for each model in the
    plan's order) checked as :func:`planned_model` checks the primary's. A board model
    planned from a preset names no file: refused unless given."""
    if given and len(given) != len(plan.models):
        raise UsageError(
            f"--board-model given {len(given)} times for a plan of {len(plan.models)} other "
            "models: give one for each, in the plan's order",
        )
    out = []
    for i, m in enumerate(plan.models):
        copy = given[i] if given else None
        if m.model.path is None and copy is None:
            raise RefusedError(
                f"plan.models[{i}] ({m.serving.name}) was planned for the preset "
                f"{m.model.preset!r} and names no file to deploy",
                facts={"model": m.serving.name, "preset": m.model.preset},
                hint="plan the board with that model's file: --model FILE,name=...",
            )
        # The projector is the primary's (planned_model checks it once, for the primary).
        alone = replace(plan, model=m.model, projector=None)
        out.append(planned_model(alone, copy, root, progress, digests))
    return tuple(out)


def deployed_plan(
    plan: Plan, model: ModelSource | None, others: tuple[ModelSource, ...] = ()
) -> Plan:
    """The plan as apply installs it: its models (and projector) are the installed files
    (path, size, sha256): the primary's ``model`` and its projector, and ``others`` for
    ``plan.models`` in order."""
    if model is not None:
        assert isinstance(model.spec, ModelSpec)
        projector = model.projector.spec if model.projector is not None else plan.projector
        assert projector is None or isinstance(projector, ProjectorSpec)
        plan = replace(plan, model=model.spec, projector=projector)
    if others:
        specs = [o.spec for o in others]
        assert all(isinstance(spec, ModelSpec) for spec in specs)
        models = tuple(
            replace(m, model=cast(ModelSpec, spec))
            for m, spec in zip(plan.models, specs, strict=True)
        )
        plan = replace(plan, models=models)
    return plan


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

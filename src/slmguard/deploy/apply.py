"""apply: bring a root to the deployment a plan describes, recording how to undo it.

Owns :func:`apply_plan`: read the target (:mod:`slmguard.deploy.target`), render for it
(:mod:`slmguard.deploy.render`, pure), compare (:mod:`slmguard.deploy.changes`), weigh
the writes against free space (:mod:`slmguard.deploy.space`: 73, nothing written), then
for each difference record the current state in the manifest
(:mod:`slmguard.deploy.manifest`: the first record of a path is kept; the deployment it
replaces goes to ``previous-<gen>/``; the running sysctl values the first time the
sysctl file is written) *before* the first target is touched, and write the new content
atomically (:mod:`slmguard.deploy.writer`). It labels the deployment with a fleet's
``rollout`` when given, makes up the admin token only where none exists (0600, shown as
``<secret, N bytes>``), and runs ``sysctl --system`` and ``systemctl daemon-reload``
only on ``/`` (:mod:`slmguard.deploy.hosttools`). ``docs/deploy.md`` (apply, step by
step) tells the steps.

It must not write before every refusal has been checked (a refused apply touches no
file), write anything a second apply of the same plan would change, or undo anything
itself (:mod:`slmguard.deploy.rollback`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slmguard.deploy.changes import Change, Removal, compute_changes, stale_paths, unified_diff
from slmguard.deploy.digests import Digests, load_digests
from slmguard.deploy.hosttools import SYSTEM_ROOT, post_commands, run_commands
from slmguard.deploy.manifest import (
    APPLY_DIR,
    BACKUP_DIR,
    MANIFEST_DEST,
    PREVIOUS_PREFIX,
    Manifest,
    Previous,
    backup_dest,
    check_rollout,
    load_manifest,
    remove_stale_previous,
    remove_tree,
    state_entry,
)
from slmguard.deploy.modelfile import ModelSource, can_link
from slmguard.deploy.render import Deployment, RenderedFile, RenderOptions, render_deployment
from slmguard.deploy.rootpath import check_root
from slmguard.deploy.space import check_space, model_links, needed_bytes
from slmguard.deploy.system import SYSCTL_PATH, sysctl_keys
from slmguard.deploy.target import (
    Current,
    TargetState,
    file_digest,
    read_destination,
    read_destinations,
    read_target,
)
from slmguard.deploy.units import PLAN_PATH, PROTECT_DROPIN, UNIT_DIR
from slmguard.deploy.writer import RootWriter
from slmguard.errors import RefusedError, UsageError
from slmguard.plan.schema import Plan

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]
"""Called as ``progress(done_bytes, total_bytes)`` while the model is copied."""

#: Files removed as stale are shown in the diff up to this size (larger: their size).
STALE_READ_LIMIT = 1 << 20


@dataclass(frozen=True)
class ApplyResult:
    changes: tuple[Change, ...]
    notes: tuple[str, ...]
    manifest: Path | None  # None in dry-run or when nothing changed
    commands: tuple[tuple[str, ...], ...] = ()  # post-apply tools that ran
    failed_commands: tuple[str, ...] = ()
    dry_run: bool = False
    removals: tuple[Removal, ...] = ()  # files of an earlier apply no longer wanted
    model_install: str | None = None  # "hard link" or "copy" when the model was installed
    #: How each model installed was: its destination -> "hard link" or "copy" (a board's
    #: other models too).
    model_installs: Mapping[str, str] = field(default_factory=dict)
    previous_kept: bool = False  # the replaced deployment is kept for rollback --to previous
    finished: bool = False  # nothing to change, but an apply that had died was marked done
    #: The deployment before and after this apply: its plan.json's sha256 (None: none, or
    #: an old manifest's) and the rollout that made it.
    plan_sha256_before: str | None = None
    plan_sha256_after: str | None = None
    rollout_before: str | None = None
    rollout_after: str | None = None
    reboot_paths: tuple[str, ...] = ()  # changed boot files: they take effect at the next boot

    @property
    def diff(self) -> str:
        return unified_diff(self.changes, self.removals)

    @property
    def changed(self) -> bool:
        return bool(self.changes or self.removals)


def make_secret(entropy_bytes: int) -> bytes:
    """A fresh random secret as the file holds it (URL-safe text and a newline)."""
    return (secrets.token_urlsafe(entropy_bytes) + "\n").encode("ascii")


def parent_dest(dest: str) -> str:
    """The directory a destination is in (``/etc/fstab`` -> ``/etc``)."""
    return dest.rsplit("/", 1)[0] or "/"


def _note_created_dirs(w: RootWriter, manifest: Manifest, changes: list[Change]) -> None:
    """Add the directories this apply will create to the manifest (its own, then the targets').

    The targets' new directories are also the current deployment's own
    (``previous.created_dirs``): going back one plan removes them when empty.
    """
    new_dirs = w.missing_dirs(BACKUP_DIR)
    targets: list[str] = []
    for c in changes:
        targets += [d for d in w.missing_dirs(parent_dest(c.path)) if d not in targets]
    for dest in new_dirs + targets:
        if dest not in manifest.created_dirs:
            manifest.created_dirs.append(dest)
    prev = manifest.previous
    if prev is not None and not prev.initial:
        prev.created_dirs += [d for d in targets if d not in prev.created_dirs]


def _record(w: RootWriter, manifest: Manifest, changes: list[Change], target: TargetState) -> Path:
    """Back up what the changes replace (first records only) and write the manifest."""
    _note_created_dirs(w, manifest, changes)
    w.make_dirs(BACKUP_DIR)
    w.chmod(APPLY_DIR, 0o700)  # backups of /etc and /boot: root's eyes only
    known = manifest.paths()
    for c in changes:
        if c.path not in known:
            if c.old_bytes is not None:
                backup = backup_dest(c.path)
                w.make_dirs(parent_dest(backup))
                w.write(backup, c.old_bytes, 0o600)
            manifest.entries.append(state_entry(c.path, c.current, "backup"))
        if c.path == SYSCTL_PATH and not manifest.sysctl_before:
            keys = sysctl_keys((c.file.content or b"").decode("utf-8", "replace"))
            manifest.sysctl_before = {
                k: target.running_sysctls[k] for k in keys if k in target.running_sysctls
            }
    return _write_manifest(w, manifest)


def _write_manifest(w: RootWriter, manifest: Manifest) -> Path:
    w.write(MANIFEST_DEST, manifest.to_json().encode(), 0o600)
    return w.path(MANIFEST_DEST)


def _save_state(
    w: RootWriter, dest: str, now: Current, base: str, digests: Digests
) -> dict[str, object]:
    """Keep ``dest``'s current state under ``base`` (bytes, or a hard link of a large file)."""
    if now.kind != "file":
        return state_entry(dest, now, base)
    copy = backup_dest(dest, base)
    w.make_dirs(parent_dest(copy))
    if now.data is not None:
        w.write(copy, now.data, 0o600)
        return state_entry(dest, now, base)
    source = w.path(dest)
    digest = file_digest(source, digests)
    if not w.hardlink(copy, source):
        w.copy(copy, source, sha256=digest, mode=0o600)
    return state_entry(dest, now, base, sha256=digest)


def _keep_previous(
    w: RootWriter,
    manifest: Manifest,
    first: bool,
    states: list[tuple[str, Current]],
    digests: Digests,
) -> None:
    """Keep the deployment being replaced: the state of each path about to change.

    The first apply's previous state is the one before it (the manifest's own
    entries). After a finished apply the previous deployment starts anew,
    under the next generation; after one that died the last finished one is
    kept and only paths it does not hold yet are added.
    """
    if first:
        manifest.gen = 1
        manifest.previous = Previous(1, initial=True)
    elif manifest.complete or manifest.previous is None:
        manifest.gen += 1
        manifest.previous = Previous(
            manifest.gen, plan_sha256=manifest.plan_sha256, rollout=manifest.rollout
        )
        remove_tree(w, f"{APPLY_DIR}/{manifest.previous.base}")  # a dead attempt's files
    prev = manifest.previous
    if prev.initial:
        return
    w.make_dirs(f"{APPLY_DIR}/{prev.base}")
    w.chmod(APPLY_DIR, 0o700)
    kept = prev.paths()
    for dest, now in states:
        if dest not in kept:
            prev.entries.append(_save_state(w, dest, now, prev.base, digests))
            kept.add(dest)


def _plan_sha256(files: Iterable[RenderedFile]) -> str | None:
    """The sha256 of the deployment's plan.json: which plan a manifest's deployment is."""
    for f in files:
        if f.path == PLAN_PATH and f.content is not None:
            return hashlib.sha256(f.content).hexdigest()
    return None


def _install_model(w: RootWriter, change: Change, progress: ProgressFn | None) -> str:
    """Put the model in place: a hard link when it may be one, else a checked copy."""
    m = change.file.model
    assert m is not None
    if can_link(m.source) and w.hardlink(change.path, m.source):
        return "hard link"
    w.copy(change.path, m.source, sha256=m.sha256, mode=change.file.mode, progress=progress)
    return "copy"


def _write(w: RootWriter, change: Change, progress: ProgressFn | None = None) -> str | None:
    """Put one change in place (the manifest already records what it replaces).

    Returns how the model was installed, for the model's change.
    """
    f = change.file
    w.make_dirs(parent_dest(change.path))
    how = None
    if f.model is not None:
        how = _install_model(w, change, progress)
    elif f.link is not None:
        w.link(change.path, f.link)
    elif f.secret_bytes is not None:  # only ever created, never replaced
        w.write(change.path, make_secret(f.secret_bytes), f.mode)
    else:
        mode, owner = f.mode, None
        now = change.current
        if change.old_bytes is not None and now.mode is not None:  # keep mode and owner
            mode = now.mode
            owner = None if now.uid is None or now.gid is None else (now.uid, now.gid)
        w.write(change.path, f.content or b"", mode, owner)
    log.info("%s %s", change.action, change.path)
    return how


def _removals(
    root: Path, manifest: Manifest | None, files: Iterable[RenderedFile]
) -> list[Removal]:
    """Files an earlier apply created that this deployment no longer has: removed now.

    Only paths the manifest records as "did not exist" (a ``--protect`` drop-in
    dropped from the command line, the model of an earlier plan, a renamed
    business slice); files that existed before apply stay as they are until
    rollback restores them. The manifest keeps the record, so rollback is
    unchanged by the removal.
    """
    if manifest is None:
        return []
    created = [str(e["path"]) for e in manifest.entries if not e["existed"]]
    out = []
    for dest in stale_paths(created, (f.path for f in files)):
        now = read_destination(root, dest, read_limit=STALE_READ_LIMIT)
        if now.kind in ("file", "link"):
            out.append(Removal(dest, now))
    return out


_PROTECT_DROPIN_PATH = re.compile(
    rf"{re.escape(UNIT_DIR)}/([^/]+\.service)\.d/{re.escape(PROTECT_DROPIN)}"
)


def protected_services(root: Path) -> tuple[str, ...]:
    """The services the deployment in place protects (``--protect``), which the next
    ``apply`` keeps when it is given none: the business-slice drop-ins apply wrote that
    are still there (a rollback to a plan without one removed it). The names come from
    the manifest, a file on the target: render validates them as it validates the flag.
    """
    manifest = load_manifest(root)
    if manifest is None:
        return ()
    names = []
    for e in manifest.entries:
        match = _PROTECT_DROPIN_PATH.fullmatch(str(e["path"]))
        if match and read_destination(root, match.group(0), read_limit=0).kind == "file":
            names.append(match.group(1))
    return tuple(sorted(names))


def _refuse_foreign_model(changes: list[Change], manifest: Manifest | None) -> None:
    """A file at the model's destination that apply did not put there is not replaced."""
    known = manifest.paths() if manifest is not None else set()
    for c in changes:
        if c.file.model is not None and c.current.exists and c.path not in known:
            raise RefusedError(
                f"{c.path} exists and was not installed by slmguard apply: refusing to "
                "replace it (apply keeps no backup of a model)",
                facts={"path": c.path},
                hint="move it away, or remove it if it is an old copy of the model",
            )


def _check_own_paths(w: RootWriter, manifest: Manifest | None, paths: list[str]) -> None:
    """apply's own files stay inside the root too (checked before the first write)."""
    w.path(MANIFEST_DEST)
    gen = 1 if manifest is None else manifest.gen + 1
    bases = {"backup", f"{PREVIOUS_PREFIX}{gen}"}
    if manifest is not None and manifest.previous is not None:
        bases.add(manifest.previous.base)
    for dest in paths:
        for base in bases:
            w.path(backup_dest(dest, base))


def _pending(
    root: Path,
    plan: Plan,
    opts: RenderOptions,
    model: ModelSource | None,
    digests: Digests,
    others: tuple[ModelSource, ...] = (),
) -> tuple[TargetState, Deployment, list[Change], list[Removal], Manifest | None]:
    """What apply is about to do: the target read, the deployment rendered for it, what
    differs, what an earlier apply left that goes, and that earlier apply's manifest."""
    target = read_target(root, plan)
    deployment = render_deployment(plan, opts, target, model, others)
    models = {f.path: f.model for f in deployment.files if f.model is not None}
    current = read_destinations(root, (f.path for f in deployment.files), models, digests)
    changes = compute_changes(deployment.files, current)
    loaded = load_manifest(root)
    removals = _removals(root, loaded, deployment.files)
    _refuse_foreign_model(changes, loaded)
    return target, deployment, changes, removals, loaded


def _finish_died(w: RootWriter, loaded: Manifest | None) -> bool:
    """An apply that died after its last write: the target matches, so record it finished."""
    if loaded is None or loaded.complete:
        return False
    loaded.complete = True
    _write_manifest(w, loaded)
    return True


def _write_deployment(
    w: RootWriter, changes: list[Change], removals: list[Removal], progress: ProgressFn | None
) -> dict[str, str]:
    """Write every change and remove the stale files; how each model was installed."""
    installs = {}
    for c in changes:
        how = _write(w, c, progress)
        if how is not None:
            installs[c.path] = how
    for r in removals:
        w.remove(r.path)
        log.info("remove %s", r.path)
    return installs


def apply_plan(
    plan: Plan,
    opts: RenderOptions,
    root: Path = SYSTEM_ROOT,
    *,
    model: ModelSource | None = None,
    dry_run: bool = False,
    run_tools: bool = True,
    progress: ProgressFn | None = None,
    digests: Digests | None = None,
    others: tuple[ModelSource, ...] = (),
    rollout: str | None = None,
) -> ApplyResult:
    """Bring ``root`` to the deployment ``plan`` describes (see the module docstring).

    ``model``: the checked model (``modelfile.planned_model``), installed and
    named in the installed plan; None installs none. ``others``: a board's other
    models (``modelfile.board_models``), the same way. ``progress(done, total)``
    while one is copied. ``digests``: the root's model stamps (default: read).
    ``rollout``: the label recorded with the deployment when this apply changes it.
    """
    check_root(root)
    _check_rollout_arg(rollout)
    digests = digests if digests is not None else load_digests(root)
    target, deployment, changes, removals, loaded = _pending(
        root, plan, opts, model, digests, others
    )
    w = RootWriter(root)
    _check_own_paths(w, loaded, [c.path for c in changes] + [r.path for r in removals])
    plan_before = None if loaded is None else loaded.plan_sha256
    rollout_before = None if loaded is None else loaded.rollout
    if dry_run or not (changes or removals):
        finished = not dry_run and _finish_died(w, loaded)
        if not dry_run:
            digests.save()  # only a cache: the stamps of a model it had to hash
        return ApplyResult(
            tuple(changes),
            deployment.notes,
            None,
            dry_run=dry_run,
            removals=tuple(removals),
            finished=finished,
            plan_sha256_after=_plan_sha256(deployment.files),
            plan_sha256_before=plan_before,
            rollout_before=rollout_before,
            rollout_after=rollout if dry_run and (changes or removals) else rollout_before,
            reboot_paths=_reboot_paths(changes, target),
        )
    # A full disk refuses here, before the first write (73, with the numbers).
    linked = model_links(changes, root)
    check_space(root, needed_bytes(changes, removals, linked=linked))
    manifest = loaded or Manifest(str(root))
    states = [(c.path, c.current) for c in changes] + [(r.path, r.current) for r in removals]
    _keep_previous(w, manifest, loaded is None, states, digests)
    manifest.plan_sha256 = _plan_sha256(deployment.files)
    manifest.rollout = rollout
    manifest.complete = False
    manifest_path = _record(w, manifest, changes, target)
    remove_stale_previous(w, manifest)
    installs = _write_deployment(w, changes, removals, progress)
    manifest.complete = True
    _write_manifest(w, manifest)
    for m in ([model] if model is not None else []) + list(others):
        digests.remember(m.source, m.sha256)
        digests.remember(w.path(m.dest), m.sha256)
    digests.save()
    cmds = post_commands(root, [path for path, _ in states]) if run_tools else []
    failed = run_commands(cmds)
    return ApplyResult(
        tuple(changes),
        deployment.notes,
        manifest_path,
        tuple(cmds),
        tuple(failed),
        removals=tuple(removals),
        model_install=installs.get(model.dest) if model is not None else None,
        model_installs=installs,
        previous_kept=manifest.previous is not None and not manifest.previous.initial,
        plan_sha256_before=plan_before,
        plan_sha256_after=manifest.plan_sha256,
        rollout_before=rollout_before,
        rollout_after=rollout,
        reboot_paths=_reboot_paths(changes, target),
    )


def _check_rollout_arg(rollout: str | None) -> None:
    try:
        check_rollout(rollout)
    except ValueError as err:
        raise UsageError(f"--rollout: {err}") from None


def _reboot_paths(changes: list[Change], target: TargetState) -> tuple[str, ...]:
    """The changed boot file (its ``cma=`` takes effect at the next boot), if any."""
    boot = target.boot
    return tuple(c.path for c in changes if boot is not None and c.path == boot.dest)

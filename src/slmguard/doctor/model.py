"""The model file's integrity: its bytes are still the ones the plan was made for.

Owns ``model.sha256``, run only when the doctor was asked to hash the model
(``doctor --verify-model``: the snapshot then holds the digest of the plan's
model file, read whole). apply and the fleet's staging trust a file whose
size, inode and mtime are unchanged since they hashed it; a bit flipped on an
SD card with its mtime kept gets past them, and only reading every byte finds
it. A board plan's other models and its vision projector (issues 39, 42) are
hashed with it, one finding each naming its file (``model.sha256.models[I]``,
``model.sha256.projector``). Pure functions of the snapshot, like every check.
"""

from __future__ import annotations

from slmguard.doctor.findings import CheckId, Evidence, Finding
from slmguard.host.filedigest import FileDigest
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.schema import Plan

CHECK = CheckId("model.sha256", "The model's bytes are the plan's")
PROJECTOR = CheckId("model.sha256.projector", "The vision projector's bytes are the plan's")
_FIX = (
    "put the right file back: in a fleet, run the rollout again (`slmguard stage --verify` "
    "downloads it anew); by hand, copy the model again and run `slmguard apply` (the "
    "manifest's hard link of the previous model is the same inode: it has rotted too)"
)


def check_model_sha256(s: HostSnapshot, plan: Plan | None) -> Finding:
    if plan is None or plan.model.path is None or plan.model.sha256 is None:
        return CHECK.unknown("the plan names no model file with a sha256 (a preset plan?)")
    digest = s.model_digest
    if digest is None:
        return CHECK.unknown("not asked: --verify-model reads the whole model to hash it")
    return _compare(CHECK, "model", digest, s, plan.model.sha256, plan.model.file_bytes)


def planned_files(plan: Plan) -> tuple[tuple[CheckId, str, str, int], ...]:
    """The plan's other files with a path and a sha256, each (its check, path, sha256,
    size): a board's models (``plan.models``, issue 39), then the projector (issue 42)."""
    out = []
    for i, m in enumerate(plan.models):
        if m.model.path is not None and m.model.sha256 is not None:
            check = CheckId(f"model.sha256.models[{i}]", "A board model's bytes are the plan's")
            out.append((check, m.model.path, m.model.sha256, m.model.file_bytes))
    v = plan.projector
    if v is not None and v.sha256 is not None:
        out.append((PROJECTOR, v.path, v.sha256, v.file_bytes))
    return tuple(out)


def check_model_files(s: HostSnapshot, plan: Plan | None) -> tuple[Finding, ...]:
    """One finding for each of the plan's other files the snapshot hashed, naming it."""
    if plan is None:
        return ()
    digests = dict(s.file_digests)
    return tuple(
        _compare(check, "projector" if check is PROJECTOR else "model", digests[path], s, sha, size)
        for check, path, sha, size in planned_files(plan)
        if path in digests
    )


def _compare(
    check: CheckId, what: str, digest: FileDigest | Unread, s: HostSnapshot, sha256: str, size: int
) -> Finding:
    if isinstance(digest, Unread):
        return check.fail(f"cannot read the plan's {what}: {digest}", fix=_FIX)
    ev = (
        Evidence("sha256 now", digest.sha256, str(s.root / digest.path.lstrip("/"))),
        Evidence("plan's sha256", sha256, "plan"),
        Evidence("size now", f"{digest.size_bytes} bytes", digest.path),
        Evidence("plan's size", f"{size} bytes", "plan"),
    )
    if digest.sha256 != sha256 or digest.size_bytes != size:
        return check.fail(
            f"{digest.path} is not the plan's {what} any more: sha256 "
            f"{digest.sha256[:16]}..., the plan's {sha256[:16]}... (the file rotted "
            "or was replaced)",
            ev,
            fix=_FIX,
        )
    return check.passed(f"{digest.path}: every byte read, sha256 as planned", ev)

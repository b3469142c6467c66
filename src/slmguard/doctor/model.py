"""The model file's integrity: its bytes are still the ones the plan was made for.

Owns ``model.sha256``, run only when the doctor was asked to hash the model
(``doctor --verify-model``: the snapshot then holds the digest of the plan's
model file, read whole). apply and the fleet's staging trust a file whose
size, inode and mtime are unchanged since they hashed it; a bit flipped on an
SD card with its mtime kept gets past them, and only reading every byte finds
it. A pure function of the snapshot, like every check.
"""

from __future__ import annotations

from slmguard.doctor.findings import CheckId, Evidence, Finding
from slmguard.host.snapshot import HostSnapshot, Unread
from slmguard.plan.schema import Plan

CHECK = CheckId("model.sha256", "The model's bytes are the plan's")
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
    if isinstance(digest, Unread):
        return CHECK.fail(f"cannot read the plan's model: {digest}", fix=_FIX)
    ev = (
        Evidence("sha256 now", digest.sha256, str(s.root / digest.path.lstrip("/"))),
        Evidence("plan's sha256", plan.model.sha256, "plan"),
        Evidence("size now", f"{digest.size_bytes} bytes", digest.path),
        Evidence("plan's size", f"{plan.model.file_bytes} bytes", "plan"),
    )
    if digest.sha256 != plan.model.sha256 or digest.size_bytes != plan.model.file_bytes:
        return CHECK.fail(
            f"{digest.path} is not the plan's model any more: sha256 "
            f"{digest.sha256[:16]}..., the plan's {plan.model.sha256[:16]}... (the file rotted "
            "or was replaced)",
            ev,
            fix=_FIX,
        )
    return CHECK.passed(f"{digest.path}: every byte read, sha256 as planned", ev)

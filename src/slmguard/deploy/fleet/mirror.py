"""The model mirror a fleet downloads from: its URL, checked, and each model's URL in it.

Owns ``render --model-mirror URL`` for both fleet targets: the Ansible role's
boards download ``URL/FILE`` with ``get_url`` (checked by sha256), the
Kubernetes pods' init container does (:mod:`slmguard.deploy.fleet.podinit`).
The base URL is the operator's; it is still held to a plain shape (http or
https, a host, no credentials, query, fragment or whitespace), and the file
name comes from the checked model, reduced to safe characters and
percent-quoted.
"""

from __future__ import annotations

import urllib.parse
from pathlib import PurePosixPath

from slmguard.deploy import escape
from slmguard.deploy.modelfile import ModelSource
from slmguard.errors import UsageError


def check_mirror(url: str) -> str:
    """``--model-mirror``: an http(s) base URL (UsageError otherwise), without a trailing ``/``."""
    parts = urllib.parse.urlsplit(url)
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.query
        or parts.fragment
        or any(c.isspace() or not c.isprintable() for c in url)
    ):
        raise UsageError(
            f"--model-mirror {url!r}: need an http:// or https:// base URL (no credentials, "
            "query or spaces)",
            hint="e.g. --model-mirror https://mirror.example/models",
        )
    return url.rstrip("/")


def model_file_name(model: ModelSource) -> str:
    """The model's file name on a board and in the mirror (safe characters only)."""
    return escape.file_name(PurePosixPath(str(model.source)).name)


def model_url(mirror: str, model: ModelSource) -> str:
    """Where the mirror serves ``model``: ``MIRROR/FILE``."""
    return f"{mirror}/{urllib.parse.quote(model_file_name(model))}"

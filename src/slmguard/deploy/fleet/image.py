"""The server image the Kubernetes manifests run: where it keeps slmguard, its engine, its user.

Owns the facts of ``container/Containerfile`` that the rendered pods depend on
(kept equal to the file by ``tests/test_container.py``): the virtual
environment slmguard and ``llama-server`` are installed in, and the UID/GID
the image runs as (the pods' ``runAsUser``). Its ENTRYPOINT is
``slmguard serve``, so the DaemonSet gives only the arguments.
"""

from __future__ import annotations

CONTAINER_VENV = "/opt/slmguard/venv"
CONTAINER_PYTHON = f"{CONTAINER_VENV}/bin/python"
CONTAINER_ENGINE = f"{CONTAINER_VENV}/bin/llama-server"
CONTAINER_UID = 65532

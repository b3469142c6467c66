"""Check the model file before serving, without growing the front process.

Owns :func:`probe_model`: it runs :func:`slmguard.modelfacts.read_model_facts`
in a short-lived forked child and returns the two facts the front needs (the
architecture and the GGUF chat template). Reading the header pulls in the
``gguf`` package and numpy, about 30 MB that the front would otherwise keep
for its whole life; the child takes them with it when it exits. Errors come
back as the same :class:`ModelNotFoundError` / :class:`ModelError`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slmguard.errors import ModelError, ModelNotFoundError


@dataclass(frozen=True)
class ModelProbe:
    arch: str
    chat_template: str | None


def _probe_here(path: Path) -> dict[str, Any]:
    from slmguard.modelfacts import read_model_facts

    try:
        facts = read_model_facts(path)
    except ModelNotFoundError as err:
        return {"error": "missing", "path": str(err.path), "hint": err.hint}
    except ModelError as err:
        return {"error": "bad", "path": str(err.path), "problem": err.problem, "hint": err.hint}
    return {"arch": facts.arch, "chat_template": facts.chat_template}


def _result(data: dict[str, Any]) -> ModelProbe:
    if data.get("error") == "missing":
        raise ModelNotFoundError(data["path"], hint=data.get("hint"))
    if data.get("error") == "bad":
        raise ModelError(data["path"], data["problem"], hint=data.get("hint"))
    return ModelProbe(arch=str(data["arch"]), chat_template=data.get("chat_template"))


def probe_model(path: Path, *, fork: bool = True) -> ModelProbe:
    """Facts the server needs from ``path``; raises ModelNotFoundError / ModelError."""
    if not fork:
        return _result(_probe_here(path))
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into the caller's stack
        code = 0
        try:
            os.close(read_fd)
            try:
                data = _probe_here(path)
            except Exception as err:  # report anything unexpected to the parent
                data = {"error": "bad", "path": str(path), "problem": f"unreadable: {err}"}
            with os.fdopen(write_fd, "w", encoding="utf-8") as out:
                json.dump(data, out)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, encoding="utf-8") as inp:
        text = inp.read()
    os.waitpid(pid, 0)
    try:
        data = json.loads(text)
    except ValueError:
        data = {"error": "bad", "path": str(path), "problem": "the header check crashed"}
    return _result(data)

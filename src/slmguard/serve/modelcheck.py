"""Check the model file before serving, without growing the front process.

Owns :func:`probe_model`: it runs :func:`slmguard.plan.modelfacts.read_model_facts`
in a short-lived forked child and returns its :class:`ModelFacts` (without the
per-tensor table). Reading the header pulls in the ``gguf`` package and numpy,
about 30 MB that the front would otherwise keep for its whole life; the child
takes them with it when it exits. Errors come back as the same
:class:`ModelNotFoundError` / :class:`ModelError`.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

from slmguard.errors import ModelError, ModelNotFoundError
from slmguard.plan.modelfacts import ModelFacts


def _probe_here(path: Path) -> dict[str, Any]:
    from slmguard.plan.modelfacts import read_model_facts

    try:
        facts = read_model_facts(path)
    except ModelNotFoundError as err:
        return {"error": "missing", "path": str(err.path), "hint": err.hint}
    except ModelError as err:
        return {"error": "bad", "path": str(err.path), "problem": err.problem, "hint": err.hint}
    return {"facts": dataclasses.replace(facts, tensors=())}


def _result(data: dict[str, Any]) -> ModelFacts:
    if data.get("error") == "missing":
        raise ModelNotFoundError(data["path"], hint=data.get("hint"))
    if data.get("error") == "bad":
        raise ModelError(data["path"], data["problem"], hint=data.get("hint"))
    facts: ModelFacts = data["facts"]
    return facts


def probe_model(path: Path, *, fork: bool = True) -> ModelFacts:
    """The header facts of ``path``; raises ModelNotFoundError / ModelError."""
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
            with os.fdopen(write_fd, "wb") as out:
                pickle.dump(data, out)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as inp:
        payload = inp.read()
    os.waitpid(pid, 0)
    try:
        # Trusted: written by our own forked child a moment ago.
        data = pickle.loads(payload)
    except (pickle.UnpicklingError, EOFError, ValueError):
        data = {"error": "bad", "path": str(path), "problem": "the header check crashed"}
    return _result(data)

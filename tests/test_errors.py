"""errors: the one tree, its exit-code table (CLI) and its envelope table (HTTP)."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slmguard import errors
from slmguard.errors import (
    EXIT_CODES,
    APIError,
    BootFileError,
    ClientCooldownError,
    ConfigError,
    DownloadError,
    EngineBusyError,
    EngineError,
    EngineGoneError,
    EngineLoadError,
    EngineNotReadyError,
    EngineStalledError,
    EngineUnavailableError,
    EngineUnreachableError,
    GenerationStalledError,
    GrammarLimitError,
    HostReadError,
    HostWriteError,
    ModelError,
    ModelMismatchError,
    ModelNotFoundError,
    NoSpaceError,
    NotFoundError,
    OverloadedError,
    PlanError,
    QueueFullError,
    RefusedError,
    RequestAbortedError,
    RequestError,
    RequestTooLargeError,
    SessionIdError,
    SessionStoreError,
    SessionStoreFullError,
    SlmguardError,
    UnsafeBindError,
    UsageError,
    WrongModelError,
    envelope,
    exit_code,
)

EXIT_TABLE_DOC = Path(__file__).parent.parent / "docs/cli.md"

ALL = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, SlmguardError) and cls.__module__ == errors.__name__
]


EXIT_TABLE: list[tuple[SlmguardError, int]] = [
    (SlmguardError("x"), 70),
    (UsageError("x"), 64),
    (ModelError("m.gguf", "not GGUF"), 65),
    (ModelNotFoundError("m.gguf"), 66),
    (ModelMismatchError("m.gguf", "sha256", "aa", "bb", hint=None), 65),
    (EngineLoadError("m.gguf", "unknown model architecture"), 65),
    (ConfigError("x"), 78),
    (PlanError("x", need_bytes=2, have_bytes=1), 78),
    (WrongModelError("x", path="m.gguf", facts={"n_layer": (18, 26)}), 78),
    (RefusedError("x"), 78),
    (UnsafeBindError("0.0.0.0"), 78),
    (BootFileError("/boot/x", "bad", lineno=3), 78),
    (HostReadError("/proc/x", "missing"), 74),
    (HostWriteError("/etc/x", "read-only"), 73),
    (DownloadError("http://m/x", "timed out", attempts=6, done_bytes=10), 69),
    (NoSpaceError("/boot", 1 << 20, 4096), 73),
    (RequestError("x"), 64),
    (SessionIdError("a b"), 64),
    (RequestTooLargeError("x"), 64),
    (OverloadedError("x"), 69),
    (QueueFullError(4), 69),
    (ClientCooldownError("10.0.0.9", 300), 69),
    (GrammarLimitError("x", param="grammar"), 64),
    (SessionStoreError("/s.db", "locked"), 74),
    (SessionStoreFullError("/s.db", 0), 74),
    (EngineUnavailableError("llama-server"), 69),
    (EngineError("x"), 70),
    (EngineNotReadyError("loading"), 69),
    (EngineGoneError(), 69),
    (NotFoundError("x"), 64),
    (RequestAbortedError("the memory governor parked the engine"), 69),
    (GenerationStalledError(16.0), 69),
    (EngineUnreachableError("x"), 69),
    (EngineBusyError("x"), 69),
    (EngineStalledError(), 69),
    (APIError(401, "x"), 70),
]


@pytest.mark.parametrize(("err", "code"), EXIT_TABLE)
def test_exit_code_table(err: SlmguardError, code: int) -> None:
    assert exit_code(err) == exit_code(type(err)) == err.exit_code == code


def test_every_class_is_in_the_table_test_and_the_drawn_tree() -> None:
    tested = {type(e) for e, _ in EXIT_TABLE}
    assert set(ALL) == tested
    doc = errors.__doc__ or ""
    assert not [c.__name__ for c in ALL if not re.search(rf"\b{c.__name__}\b", doc)]


def test_every_exit_code_is_in_the_docs_table() -> None:
    table = EXIT_TABLE_DOC.read_text(encoding="utf-8").split("## Exit codes", 1)[1]
    listed = {int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.MULTILINE)}
    assert set(EXIT_CODES.values()) | {errors.EXIT_INTERRUPTED} <= listed


@pytest.mark.parametrize(
    ("err", "status", "type_", "code", "param"),
    [
        (SlmguardError("x"), 500, "server_error", "internal_error", None),
        (HostReadError("/proc/x", "gone"), 500, "server_error", "internal_error", None),
        (RequestError("x", param="n"), 400, "invalid_request_error", "invalid_request", "n"),
        (SessionIdError("a b"), 400, "invalid_request_error", "invalid_session_id", "session_id"),
        (
            RequestTooLargeError("x", code="request_too_large"),
            400,
            "invalid_request_error",
            "request_too_large",
            None,
        ),
        (
            RequestTooLargeError("x", param="prompt"),
            400,
            "invalid_request_error",
            "context_length_exceeded",
            "prompt",
        ),
        (OverloadedError("x"), 503, "server_error", "overloaded", None),
        (SessionStoreFullError("/s.db", 0), 507, "server_error", "session_store_full", None),
        (
            OverloadedError("x", code="memory_shedding"),
            503,
            "server_error",
            "memory_shedding",
            None,
        ),
        (QueueFullError(4), 429, "rate_limit_error", "queue_full", None),
        (SessionStoreError("/s.db", "locked"), 500, "server_error", "session_store_error", None),
        (EngineError("x"), 500, "server_error", "engine_error", None),
        (EngineNotReadyError("parked"), 503, "server_error", "engine_parked", None),
        (EngineGoneError(), 503, "server_error", "engine_restarting", None),
        (EngineUnavailableError("x"), 503, "server_error", "engine_unavailable", None),
        (
            NotFoundError("x", code="model_not_found", param="model"),
            404,
            "invalid_request_error",
            "model_not_found",
            "model",
        ),
        (RequestAbortedError("parked"), 503, "server_error", "aborted", None),
        (GenerationStalledError(16.0), 503, "server_error", "generation_stalled", None),
        (EngineUnreachableError("x"), 503, "server_error", "engine_unreachable", None),
        (EngineBusyError("x"), 503, "server_error", "engine_unavailable", None),
        (EngineStalledError(), 503, "server_error", "engine_stalled", None),
        (
            APIError(401, "no key", code="invalid_api_key"),
            401,
            "authentication_error",
            "invalid_api_key",
            None,
        ),
        (
            APIError(413, "big", code="request_too_large"),
            413,
            "invalid_request_error",
            "request_too_large",
            None,
        ),
        (APIError(418, "tea", error_type="teapot"), 418, "teapot", None, None),
    ],
)
def test_envelope_table(
    err: SlmguardError, status: int, type_: str, code: str | None, param: str | None
) -> None:
    env = envelope(err)
    assert (env.status, env.type, env.code, env.param) == (status, type_, code, param)
    assert env.body() == {
        "error": {"message": err.message, "type": type_, "param": param, "code": code}
    }


def test_retry_after_default_goes_only_to_refusals_that_name_none() -> None:
    assert envelope(QueueFullError(4), retry_after_s=2).headers() == {"Retry-After": "2"}
    own = OverloadedError("x", retry_after_s=9)
    assert envelope(own, retry_after_s=2).retry_after_s == 9
    assert envelope(EngineNotReadyError("loading"), retry_after_s=2).retry_after_s == 2
    assert envelope(EngineError("x"), retry_after_s=2).headers() == {}  # a 500: no retry
    assert envelope(SessionIdError("a b"), retry_after_s=2).headers() == {}
    # An APIError is its own envelope: no default added.
    assert envelope(APIError(503, "x"), retry_after_s=2).retry_after_s is None
    assert envelope(APIError(401, "x")).headers() == {"WWW-Authenticate": "Bearer"}


def test_a_subclass_without_a_row_takes_its_parents() -> None:
    class LoadFailed(EngineError):
        pass

    assert exit_code(LoadFailed("x")) == 70
    assert envelope(LoadFailed("x")).code == "engine_error"


def test_errors_import_without_the_web_stack() -> None:
    code = (
        "import sys\n"
        "import slmguard.errors\n"
        "heavy = {'fastapi', 'starlette', 'pydantic', 'uvicorn', 'httpx'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]"

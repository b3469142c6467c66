"""The one error hierarchy of slmguard, and what each error becomes at the edges.

Every error raised on purpose derives from :class:`SlmguardError` and carries its facts
(paths, byte counts, hints) as attributes, so callers never match message text. Two
tables, looked up along the MRO (a subclass without a row takes its parent's):
:data:`EXIT_CODES` for the CLI (:func:`exit_code`, sysexits(3); docs/cli.md lists
them) and :data:`ENVELOPES` for the HTTP front (status and ``code`` of the OpenAI
envelope, :func:`envelope`). It must import nothing of the web stack, and the tree
below must stay in step with the classes (``tests/test_errors.py`` checks it):

    class                          exit  HTTP status, code
    SlmguardError                    70   500 internal_error
    ├── UsageError                   64
    ├── ModelError                   65       the file is not a usable GGUF
    │   ├── ModelNotFoundError       66
    │   ├── ModelMismatchError       65       not the file the plan was made for
    │   └── EngineLoadError          65       llama-server could not load it
    ├── ConfigError                  78       settings or plan file invalid
    │   ├── PlanError                78       the numbers do not fit
    │   ├── WrongModelError          78       a --model file is not the plan's model
    │   ├── RefusedError             78       apply/render refused before writing
    │   ├── UnsafeBindError          78       public address without an API key
    │   └── BootFileError            78       a boot file cannot be parsed or edited
    ├── HostReadError                74       a host file could not be read
    ├── HostWriteError               73       apply/rollback could not write a file
    │   └── NoSpaceError             73       apply refused: its writes would not fit
    ├── DownloadError                69       a mirror did not give the file (after retries)
    ├── RequestError                 64   400 invalid_request (a request that can never work)
    │   ├── SessionIdError           64   400 invalid_session_id
    │   ├── RequestTooLargeError     64   400 context_length_exceeded | request_too_large
    │   ├── GrammarLimitError        64   400 grammar_too_complex (the engine's work bound)
    │   └── NotFoundError            64   404 not_found (model_not_found, session_not_found...)
    ├── OverloadedError              69   503 overloaded, with Retry-After (try again later)
    │   ├── QueueFullError           69   429 queue_full
    │   ├── ClientCooldownError      69   429 client_cooldown (it keeps making the engine fail)
    │   └── RequestAbortedError      69   503 aborted (the server stopped it, with the reason)
    │       └── GenerationStalledError 69 503 generation_stalled (no progress; cancelled alone)
    ├── SessionStoreError            74   500 session_store_error
    │   └── SessionStoreFullError    74   507 session_store_full (its filesystem is full)
    ├── EngineUnavailableError       69   503 engine_unavailable (engine, web stack or UI missing)
    ├── EngineError                  70   500 engine_error (the engine failed at run time)
    │   ├── EngineNotReadyError      69   503 engine_<state> (loading, restarting, parked)
    │   ├── EngineUnreachableError   69   503 engine_unreachable (it did not answer)
    │   ├── EngineBusyError          69   503 engine_unavailable (it answered 503 itself)
    │   └── EngineGoneError          69   503 engine_restarting (it died during the request)
    │       └── EngineStalledError   69   503 engine_stalled (killed for making no progress)
    └── APIError                     70   its own status and code (an HTTP-level refusal)

An error may name its own ``code`` (``OverloadedError(code="memory_shedding")``);
:class:`APIError` is for what belongs to HTTP itself (a missing API key, a body over the
limit, an engine refusal relayed with its status). The server maps errors at one edge,
:mod:`slmguard.serve.envelope`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class SlmguardError(Exception):
    """Base class. ``message`` says what happened, ``hint`` what to do."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message

    @property
    def exit_code(self) -> int:
        """The CLI's exit status for this error (:data:`EXIT_CODES`)."""
        return exit_code(self)


class UsageError(SlmguardError):
    """Bad flags or arguments."""


class ModelError(SlmguardError):
    """A model file exists but cannot be used (not GGUF, truncated, unsupported)."""

    def __init__(self, path: Path | str, problem: str, *, hint: str | None = None) -> None:
        super().__init__(f"{path}: {problem}", hint=hint)
        self.path = Path(path)
        self.problem = problem


class ModelNotFoundError(ModelError):
    def __init__(self, path: Path | str, *, hint: str | None = None) -> None:
        super().__init__(path, "no such file", hint=hint)


class ModelMismatchError(ModelError):
    """The model file is not the one the plan was made for: ``what`` (``"size"``,
    ``"sha256"``) is ``found`` where the plan says ``expected``."""

    def __init__(
        self, path: Path | str, what: str, expected: object, found: object, *, hint: str | None
    ) -> None:
        super().__init__(path, f"{what} is {found}, the plan expects {expected}", hint=hint)
        self.what = what
        self.expected = expected
        self.found = found


class EngineLoadError(ModelError):
    """llama-server exited before it ever served this model (exit 65: the model, or the
    settings it was started with, cannot be loaded). ``log_tail`` holds its last lines."""

    def __init__(self, path: Path | str, problem: str, *, log_tail: tuple[str, ...] = ()) -> None:
        super().__init__(
            path,
            problem,
            hint="check that the file is a complete GGUF this llama-server build supports, "
            "and the engine log above",
        )
        self.log_tail = log_tail


class ConfigError(SlmguardError):
    """A setting, flag combination or plan file is invalid."""

    def __init__(
        self, message: str, *, path: Path | str | None = None, hint: str | None = None
    ) -> None:
        super().__init__(f"{path}: {message}" if path else message, hint=hint)
        self.path = Path(path) if path else None


class PlanError(ConfigError):
    """The model does not fit the board (or a requested context does not)."""

    def __init__(
        self,
        message: str,
        *,
        need_bytes: int | None = None,
        have_bytes: int | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.need_bytes = need_bytes
        self.have_bytes = have_bytes


class WrongModelError(ConfigError):
    """A model file given with ``--model`` does not match the plan (a preset's
    architecture, layers, trained context or size). ``facts`` maps each compared
    fact to ``(planned, found)``."""

    def __init__(
        self,
        message: str,
        *,
        path: Path | str,
        facts: dict[str, tuple[object, object]],
        hint: str | None = None,
    ) -> None:
        super().__init__(message, path=path, hint=hint)
        self.facts = dict(facts)


class RefusedError(ConfigError):
    """render/apply refused to write, with the numbers that made it refuse."""

    def __init__(
        self, message: str, *, facts: dict[str, object] | None = None, hint: str | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.facts = dict(facts or {})


class UnsafeBindError(ConfigError):
    """Binding a non-loopback address without an API key."""

    def __init__(self, host: str) -> None:
        super().__init__(
            f"refusing to listen on {host} without an API key",
            hint="set --api-key, SLMGUARD_API_KEY or --api-key-file, or bind 127.0.0.1",
        )
        self.host = host


class BootFileError(ConfigError):
    """A boot file (armbianEnv.txt, uEnv.txt, extlinux.conf) could not be parsed or edited.

    ``lineno`` is 1-based, or ``None`` when the problem is not tied to one line.
    """

    def __init__(
        self,
        path: Path | str,
        problem: str,
        *,
        lineno: int | None = None,
        hint: str | None = None,
    ) -> None:
        where = f"{path}:{lineno}" if lineno else str(path)
        super().__init__(f"{where}: {problem}", hint=hint)
        self.path = Path(path)
        self.problem = problem
        self.lineno = lineno


class HostReadError(SlmguardError):
    """A file under the host root could not be read or parsed."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


class HostWriteError(SlmguardError):
    """apply/rollback could not write a file under the target root (sysexits EX_CANTCREAT)."""

    def __init__(self, path: Path | str, problem: str, *, hint: str | None = None) -> None:
        super().__init__(f"{path}: {problem}", hint=hint)
        self.path = Path(path)
        self.problem = problem


class NoSpaceError(HostWriteError):
    """apply's writes would not fit the free space of a filesystem under the root: refused
    before the first write (a full disk must not leave half a deployment)."""

    def __init__(self, mount: Path | str, need_bytes: int, have_bytes: int) -> None:
        super().__init__(
            mount,
            f"apply would write about {need_bytes:,} bytes to this filesystem and it has "
            f"{have_bytes:,} free: refused before writing anything",
            hint="free space on it (old logs, crash bundles, models) and apply again",
        )
        self.need_bytes = need_bytes
        self.have_bytes = have_bytes


class DownloadError(SlmguardError):
    """A file could not be had from a mirror after ``attempts`` tries (``done_bytes`` of it
    kept to resume); ``problem`` is the last try's failure."""

    def __init__(self, url: str, problem: str, *, attempts: int, done_bytes: int) -> None:
        super().__init__(
            f"{url}: {problem} (after {attempts} attempts; {done_bytes} bytes kept to resume)",
            hint="check the mirror and the board's network; a new run resumes the download",
        )
        self.url = url
        self.problem = problem
        self.attempts = attempts
        self.done_bytes = done_bytes


# ---------------------------------------------------------------- requests and the engine


class RequestError(SlmguardError):
    """A client request the server can never answer as sent (HTTP 400).

    ``param`` names the request field at fault; ``code`` refines the table's.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.code = code
        self.param = param


class SessionIdError(RequestError):
    """A session id is empty, too long or uses characters outside [A-Za-z0-9._:-]
    (the rule ``slmguard.serve.sessions.SESSION_ID_RE`` checks)."""

    RULE = "use 1-128 characters from A-Z a-z 0-9 . _ : -"

    def __init__(self, session_id: object) -> None:
        shown = session_id[:140] if isinstance(session_id, str) else session_id
        super().__init__(f"invalid session id {shown!r}: {self.RULE}", param="session_id")
        self.session_id = session_id


class RequestTooLargeError(RequestError):
    """The request cannot fit even the full context or the memory limit, now or later.

    ``code`` is ``context_length_exceeded`` (tokens) or ``request_too_large`` (bytes).
    """

    def __init__(
        self, message: str, *, code: str = "context_length_exceeded", param: str | None = None
    ) -> None:
        super().__init__(message, code=code, param=param)


class GrammarLimitError(RequestError):
    """The request's grammar (``param``: the field it came from: ``grammar``,
    ``json_schema``, ``response_format``, ``text.format``, ``tools``) needs more parse-stack
    work for one token than the engine's bound (``--grammar-max-work``): an ambiguous
    grammar that would stall every client's decoding. The engine stopped it alone."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message, code="grammar_too_complex", param=param)


class NotFoundError(RequestError):
    """What the request names does not exist here (HTTP 404): ``code`` says what
    (``model_not_found``, ``session_not_found``, ``embeddings_unsupported``,
    ``rerank_unsupported``, ``generation_unsupported``)."""


class OverloadedError(SlmguardError):
    """The server refuses a request for now (memory pressure, a full queue): retry later.

    ``code`` says why (``memory_shedding``, ``context_degraded``, ``engine_parked``...);
    ``retry_after_s`` is the Retry-After to send (None: the server's default).
    """

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        retry_after_s: int | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.code = code
        self.retry_after_s = retry_after_s


class QueueFullError(OverloadedError):
    """``capacity`` requests already wait for the engine; one more is refused (HTTP 429)."""

    def __init__(self, capacity: int, *, retry_after_s: int | None = None) -> None:
        super().__init__(
            f"{capacity} requests are already waiting for the engine",
            retry_after_s=retry_after_s,
        )
        self.capacity = capacity


class ClientCooldownError(OverloadedError):
    """``client`` (its address) sent requests the engine proved harmful again and again (a
    crash, its grammar bound): refused for ``retry_after_s`` more seconds (HTTP 429)."""

    def __init__(self, client: str, retry_after_s: int) -> None:
        super().__init__(
            f"this client's requests made the engine fail too often; refused for "
            f"{retry_after_s} s more",
            code="client_cooldown",
            retry_after_s=retry_after_s,
        )
        self.client = client


class RequestAbortedError(OverloadedError):
    """The server stopped this request while it ran (the memory governor's abort or
    park); ``reason`` says why. The client may send it again later."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"request aborted by the server: {reason}", code="aborted")
        self.reason = reason


class GenerationStalledError(RequestAbortedError):
    """The liveness check cancelled this request alone: it made no progress for
    ``stalled_s`` (the stall time) while the engine kept serving the others, which was
    not restarted."""

    def __init__(self, stalled_s: float) -> None:
        super().__init__(
            f"it made no progress for {stalled_s:.0f} s while the engine served the other "
            "requests; it was cancelled alone"
        )
        self.code = "generation_stalled"
        self.stalled_s = stalled_s


class SessionStoreError(SlmguardError):
    """The SQLite session store could not be opened, read or written."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


class SessionStoreFullError(SessionStoreError):
    """The session store's filesystem is full: a turn cannot be stored (HTTP 507)."""

    def __init__(self, path: Path | str, free_bytes: int | None) -> None:
        free = "" if free_bytes is None else f" ({free_bytes:,} bytes free)"
        super().__init__(
            path,
            f"the session store's filesystem is full{free}: this turn cannot be stored; "
            "send it without a session_id, or retry once space is freed",
        )
        self.free_bytes = free_bytes


#: How to install what ``serve`` needs (slmguard is not on PyPI: from a clone).
SERVE_EXTRA_HINT = (
    "install the server extra: in a clone, `make` (or .venv/bin/pip install -e '.[serve]'); "
    "see docs/install.md"
)


class EngineUnavailableError(SlmguardError):
    """An optional heavy dependency (engine, web stack) is not importable."""

    def __init__(self, component: str, *, hint: str | None = None) -> None:
        super().__init__(
            f"{component} is not installed",
            hint=hint or SERVE_EXTRA_HINT,
        )
        self.component = component


class EngineError(SlmguardError):
    """The engine failed while loading or generating.

    ``retry_after_s``: for a 503 (the engine on its way back), the Retry-After its
    server expects it to serve by (None: the server's default); the relay sets it.
    """

    def __init__(
        self, message: str, *, hint: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.retry_after_s = retry_after_s


class EngineNotReadyError(EngineError):
    """The engine cannot take a request in its current ``state`` (loading, restarting, parked)."""

    def __init__(self, state: str, *, message: str | None = None) -> None:
        super().__init__(message or f"the engine is {state}; retry shortly")
        self.state = state
        self.code = f"engine_{state}"


class EngineUnreachableError(EngineError):
    """The engine did not answer: not running, restarting, or the connection broke."""


class EngineBusyError(EngineError):
    """The engine answered 503 itself (no slot free for a request it was sent)."""


class EngineGoneError(EngineError):
    """The engine process went away (exited, was killed) while serving a request."""

    def __init__(
        self, message: str = "the engine stopped during this request; retry shortly"
    ) -> None:
        super().__init__(message)


class EngineStalledError(EngineGoneError):
    """The liveness check found the engine making no progress and is replacing it."""

    def __init__(self) -> None:
        super().__init__("the engine stopped making progress and is being restarted; retry shortly")


class APIError(SlmguardError):
    """An HTTP-level refusal raised by a route, with the envelope's fields as given.

    For what belongs to HTTP itself (a missing API key: 401; a body over the
    size limit: 413; an unknown route: 404). Library errors are not wrapped in
    it: :func:`envelope` maps them by :data:`ENVELOPES`.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.error_type = error_type


# ---------------------------------------------------------------- the CLI's exit codes

EXIT_INTERRUPTED = 130  # SIGINT: 128 + 2, as shells report it
EXIT_BROKEN_PIPE = 141  # stdout's reader went away: 128 + SIGPIPE, as shells report it

#: sysexits(3) codes by class; a class without a row takes its nearest ancestor's.
EXIT_CODES: Mapping[type[SlmguardError], int] = {
    SlmguardError: 70,  # EX_SOFTWARE: an internal error
    UsageError: 64,  # EX_USAGE
    ModelError: 65,  # EX_DATAERR
    ModelNotFoundError: 66,  # EX_NOINPUT
    ConfigError: 78,  # EX_CONFIG
    HostReadError: 74,  # EX_IOERR
    HostWriteError: 73,  # EX_CANTCREAT
    DownloadError: 69,  # EX_UNAVAILABLE: the mirror
    RequestError: 64,
    OverloadedError: 69,  # EX_UNAVAILABLE
    SessionStoreError: 74,
    EngineUnavailableError: 69,
    EngineError: 70,
    EngineNotReadyError: 69,
    EngineUnreachableError: 69,
    EngineBusyError: 69,
    EngineGoneError: 69,
}


def _lookup(cls: type[SlmguardError], table: Mapping[type[SlmguardError], Any]) -> Any:
    for klass in cls.__mro__:
        if klass in table:
            return table[klass]
    return table[SlmguardError]


def exit_code(err: SlmguardError | type[SlmguardError]) -> int:
    """The exit status for an error or an error class (:data:`EXIT_CODES`).

    Example::

        exit_code(ModelNotFoundError("x.gguf"))  # 66
        exit_code(UnsafeBindError)  # 78, ConfigError's
    """
    cls = err if isinstance(err, type) else type(err)
    code: int = _lookup(cls, EXIT_CODES)
    return code


# ---------------------------------------------------------------- the HTTP envelope

#: The envelope's ``type`` by HTTP status (OpenAI's names); other statuses: server_error.
ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}

#: (HTTP status, envelope code) by class; a class without a row takes its ancestor's.
ENVELOPES: Mapping[type[SlmguardError], tuple[int, str]] = {
    SlmguardError: (500, "internal_error"),
    RequestError: (400, "invalid_request"),
    SessionIdError: (400, "invalid_session_id"),
    RequestTooLargeError: (400, "context_length_exceeded"),
    GrammarLimitError: (400, "grammar_too_complex"),
    NotFoundError: (404, "not_found"),
    OverloadedError: (503, "overloaded"),
    QueueFullError: (429, "queue_full"),
    ClientCooldownError: (429, "client_cooldown"),
    RequestAbortedError: (503, "aborted"),
    GenerationStalledError: (503, "generation_stalled"),
    SessionStoreError: (500, "session_store_error"),
    SessionStoreFullError: (507, "session_store_full"),
    EngineUnavailableError: (503, "engine_unavailable"),
    EngineError: (500, "engine_error"),
    EngineNotReadyError: (503, "engine_not_ready"),
    EngineUnreachableError: (503, "engine_unreachable"),
    EngineBusyError: (503, "engine_unavailable"),
    EngineGoneError: (503, "engine_restarting"),
    EngineStalledError: (503, "engine_stalled"),
}


@dataclass(frozen=True)
class Envelope:
    """What an HTTP client sees for one error: the status, headers and OpenAI error body."""

    status: int
    type: str
    code: str | None
    message: str
    param: str | None = None
    retry_after_s: int | None = None

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """Retry-After for a refusal to retry, WWW-Authenticate for a 401."""
        h = {}
        if self.retry_after_s is not None:
            h["Retry-After"] = str(self.retry_after_s)
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h


def envelope(err: SlmguardError, *, retry_after_s: int | None = None) -> Envelope:
    """The envelope for ``err``: :data:`ENVELOPES`, refined by the error's own facts.

    The error's ``code``, ``param`` and ``retry_after_s`` attributes, where it
    has them, replace the table's; ``retry_after_s`` here is the server's
    default Retry-After, sent with a 429 or 503 that names none. An
    :class:`APIError` is its own envelope.

    Example::

        envelope(QueueFullError(4), retry_after_s=2).status  # 429
        envelope(SessionIdError("a b")).body()["error"]["code"]  # "invalid_session_id"
    """
    if isinstance(err, APIError):
        error_type = err.error_type or ERROR_TYPES.get(err.status, "server_error")
        return Envelope(err.status, error_type, err.code, err.message, err.param, err.retry_after_s)
    status, code = _lookup(type(err), ENVELOPES)
    retry = getattr(err, "retry_after_s", None)
    if retry is None and status in (429, 503):
        retry = retry_after_s
    return Envelope(
        status,
        ERROR_TYPES.get(status, "server_error"),
        getattr(err, "code", None) or code,
        err.message,
        getattr(err, "param", None),
        retry,
    )

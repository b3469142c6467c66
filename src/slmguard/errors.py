"""The one error hierarchy of slmguard.

Every error raised on purpose by the library derives from :class:`SlmguardError`
and carries the facts (paths, byte counts, hints) as attributes, so callers never
match message text. Only the CLI turns these into printed lines and exit codes
(``exit_code`` below); the HTTP front turns engine and admission errors into the
OpenAI error envelope.

    SlmguardError                     exit 70 (internal)
    ├── UsageError                    exit 64  bad flags or arguments
    ├── ModelError                    exit 65  file is not a usable GGUF
    │   ├── ModelNotFoundError        exit 66  file missing
    │   └── EngineLoadError           exit 65  llama-server could not load it
    ├── ConfigError                   exit 78  settings or plan file invalid
    │   ├── PlanError                 exit 78  the numbers do not fit
    │   ├── RefusedError              exit 78  apply/render refused before writing
    │   ├── UnsafeBindError           exit 78  public address without an API key
    │   └── BootFileError             exit 78  a boot file cannot be parsed or edited
    ├── HostReadError                 exit 74  a host file could not be read
    ├── HostWriteError                exit 73  apply/rollback could not write a file
    ├── SessionIdError                exit 64  a malformed session id (HTTP 400)
    ├── SessionStoreError             exit 74  the session store cannot be used
    ├── EngineUnavailableError        exit 69  llama-server binary or web stack missing
    └── EngineError                   exit 70  the engine failed at run time

The exit codes follow sysexits(3); the table is also in the README.
"""

from __future__ import annotations

from pathlib import Path


class SlmguardError(Exception):
    """Base class. ``message`` says what happened, ``hint`` what to do."""

    exit_code: int = 70

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(SlmguardError):
    exit_code = 64


class ModelError(SlmguardError):
    """A model file exists but cannot be used (not GGUF, truncated, unsupported)."""

    exit_code = 65

    def __init__(self, path: Path | str, problem: str, *, hint: str | None = None) -> None:
        super().__init__(f"{path}: {problem}", hint=hint)
        self.path = Path(path)
        self.problem = problem


class ModelNotFoundError(ModelError):
    exit_code = 66

    def __init__(self, path: Path | str, *, hint: str | None = None) -> None:
        super().__init__(path, "no such file", hint=hint)


class ConfigError(SlmguardError):
    """A setting, flag combination or plan file is invalid."""

    exit_code = 78

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


class HostReadError(SlmguardError):
    """A file under the host root could not be read or parsed."""

    exit_code = 74

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


class EngineUnavailableError(SlmguardError):
    """An optional heavy dependency (engine, web stack) is not importable."""

    exit_code = 69

    def __init__(self, component: str, *, hint: str | None = None) -> None:
        super().__init__(
            f"{component} is not installed",
            hint=hint or "install the server extra: pip install 'slmguard[serve]' (see README)",
        )
        self.component = component


class EngineError(SlmguardError):
    """The engine failed while loading or generating."""


class SessionIdError(SlmguardError):
    """A session id is empty, too long or uses characters outside [A-Za-z0-9._:-]."""

    exit_code = 64

    def __init__(self, session_id: object) -> None:
        super().__init__(
            f"invalid session id {session_id!r}",
            hint="use 1-128 characters from A-Z a-z 0-9 . _ : -",
        )
        self.session_id = session_id


class SessionStoreError(SlmguardError):
    """The SQLite session store could not be opened, read or written."""

    exit_code = 74

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem


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


class HostWriteError(SlmguardError):
    """apply/rollback could not write a file under the target root (sysexits EX_CANTCREAT)."""

    exit_code = 73

    def __init__(self, path: Path | str, problem: str, *, hint: str | None = None) -> None:
        super().__init__(f"{path}: {problem}", hint=hint)
        self.path = Path(path)
        self.problem = problem


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

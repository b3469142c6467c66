"""The engine binary, llama.cpp's ``llama-server``: where it is, what it is, how it is started.

Owns four things: finding the binary (:func:`find_llama_server`: the one given, else
:mod:`slmguard.engines`' choice), asking what it is (:func:`engine_version`,
:func:`check_backend`), the command line (:func:`engine_argv`, pure: the same settings
give the same argv, which the plan benchmark uses too) and its environment
(:func:`engine_env`: no debugger forked by an abort, ``GGML_NO_BACKTRACE=1``; a Vulkan
engine's private shader cache, ``MESA_SHADER_CACHE_DIR=<state dir>/shader-cache``,
unless the operator set Mesa's).
The argv keeps the child unreachable from outside: a unix socket in a private directory
(``--host /path/engine.sock``), a per-start key in a 0600 ``--api-key-file``, no web UI;
context shift off and ``--cache-ram`` always given (``docs/serve.md`` says why).
:class:`EngineConfig` *is* the plan's
:class:`~slmguard.plan.schema.EngineSettings` plus this start's model file and template.

It must not start, watch or restart the process (:mod:`slmguard.serve.engine`).

Example::

    argv = engine_argv(Path("/usr/bin/llama-server"), EngineConfig(
        model_path="/models/m.gguf", n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=4),
        socket_path=Path("/run/slmguard/engine.sock"), api_key_file=Path("/run/k"),
        alias="m")
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slmguard.engines import engine_version as engine_version  # serve's callers use it here
from slmguard.engines import list_devices, select_engine
from slmguard.errors import ConfigError, EngineUnavailableError
from slmguard.plan.projector import ENGINE_ENV as VISION_ENV
from slmguard.plan.schema import EngineSettings, ProjectorSpec

log = logging.getLogger(__name__)

BINARY = "llama-server"
#: Under the state directory: a Vulkan engine's on-disk shader cache (Mesa's).
SHADER_CACHE_DIR = "shader-cache"
#: Mesa's variables for its shader cache (the ``MESA_GLSL_*`` names are the older
#: spellings Mesa still reads): one the operator set is left as it is.
MESA_CACHE_ENV = (
    "MESA_SHADER_CACHE_DIR",
    "MESA_SHADER_CACHE_DISABLE",
    "MESA_GLSL_CACHE_DIR",
    "MESA_GLSL_CACHE_DISABLE",
)
#: Every engine's: on an abort (``GGML_ASSERT``, ``GGML_ABORT``) ggml forks gdb (else
#: lldb) to print a backtrace and waits for it. An abort is likeliest where memory is
#: short (a load refused memory), and there the debugger needs memory too: under an
#: address-space limit gdb failed and looped, and the aborting engine stayed "loading"
#: for minutes instead of exiting to be restarted. Its own abort line stays in the log.
ABORT_ENV = {"GGML_NO_BACKTRACE": "1"}


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineSettings):
    """The engine's start parameters: the plan's engine settings, the model file, an
    optional chat template (a Jinja file instead of the GGUF's own) and a vision
    projector (``mmproj``: its file; ``mmproj_offload``: on the GPU, else
    ``--no-mmproj-offload``; ``image_max_tokens``: ``--image-max-tokens`` when planned)."""

    model_path: str
    chat_template_file: str | None = None
    pooling_type: int | None = None  # the GGUF's (an embedding model, or a reranker: 4)
    mmproj: str | None = None
    mmproj_offload: bool = False
    image_max_tokens: int | None = None

    @classmethod
    def of(
        cls, settings: EngineSettings, *, model_path: str, chat_template_file: str | None = None,
        pooling_type: int | None = None, projector: ProjectorSpec | None = None,
    ) -> EngineConfig:  # fmt: skip
        """``settings`` (every field, those serve has no flag for included) for this model
        (and the plan's ``projector``, its ``path`` the file checked)."""
        fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(EngineSettings)}
        v = projector
        return cls(**fields, model_path=model_path, chat_template_file=chat_template_file,
                   pooling_type=pooling_type, mmproj=v.path if v else None,
                   mmproj_offload=bool(v and v.offload),
                   image_max_tokens=v.image_max_tokens if v else None)  # fmt: skip


#: llama.cpp's pooling type of a reranker (``<arch>.pooling_type``).
RANK_POOLING = 4


def pooling_flag(pooling_type: int | None) -> str | None:
    """The engine flag an embedding GGUF's route needs (llama-server answers 501 on
    ``/v1/embeddings`` or ``/v1/rerank`` without it): ``--reranking`` for rank pooling,
    ``--embeddings`` for the others, none for a generative model (the GGUF decides:
    ``--reranking`` on another model scores nonsense without a word)."""
    if pooling_type is None:
        return None
    return "--reranking" if pooling_type == RANK_POOLING else "--embeddings"


def load_mode(use_mmap: bool, use_mlock: bool) -> str:
    """llama-server's ``--load-mode`` for the two booleans the plan carries."""
    if use_mmap:
        return "mmap+mlock" if use_mlock else "mmap"
    return "mlock" if use_mlock else "none"


def engine_argv(
    binary: Path,
    cfg: EngineConfig,
    *,
    socket_path: Path,
    api_key_file: Path,
    alias: str,
    slot_dir: Path | None = None,
) -> list[str]:
    """The child's command line (see the module docstring for the fixed choices).

    ``slot_dir`` enables llama-server's slot actions (the governor's slot erase
    needs ``--slot-save-path``; nothing is saved there unless asked).
    """
    argv = [
        str(binary),
        "--model", cfg.model_path,
        "--alias", alias,
        "--host", str(socket_path),
        "--api-key-file", str(api_key_file),
        "--ctx-size", str(cfg.n_ctx),
        "--batch-size", str(cfg.n_batch),
        "--ubatch-size", str(cfg.n_ubatch),
        "--threads", str(cfg.n_threads),
        "--threads-batch", str(cfg.n_threads),
        "--parallel", str(cfg.n_parallel),
        "--kv-unified" if cfg.kv_unified else "--no-kv-unified",
        "--flash-attn", "on" if cfg.flash_attn else "off",
        "--cache-type-k", cfg.kv_type,
        "--cache-type-v", cfg.kv_type,
        "--load-mode", load_mode(cfg.use_mmap, cfg.use_mlock),
        "--cache-ram", str(cfg.cache_ram_mib),
        "--no-context-shift",
        "--no-webui",
        "--metrics",
        "--slots",
        "--jinja",
        "--n-gpu-layers", str(cfg.n_gpu_layers),
        "--log-prefix",
    ]  # fmt: skip
    if cfg.device is not None:
        argv += ["--device", cfg.device]
    if not cfg.kv_offload:
        argv.append("--no-kv-offload")
    if cfg.swa_full:
        argv.append("--swa-full")
    flag = pooling_flag(cfg.pooling_type)
    if flag is not None:
        argv.append(flag)
    if slot_dir is not None:
        argv += ["--slot-save-path", str(slot_dir)]
    if cfg.chat_template_file is not None:
        argv += ["--chat-template-file", cfg.chat_template_file]
    return argv + projector_args(cfg)


def projector_args(cfg: EngineConfig) -> list[str]:
    """The projector's flags: ``--mmproj FILE``, ``--no-mmproj-offload`` unless the plan
    put it on the GPU (a GPU build would otherwise put it on its default device), and
    ``--image-max-tokens`` where planned; none without a projector."""
    if cfg.mmproj is None:
        return []
    argv = ["--mmproj", cfg.mmproj]
    if not cfg.mmproj_offload:
        argv.append("--no-mmproj-offload")
    if cfg.image_max_tokens is not None:
        argv += ["--image-max-tokens", str(cfg.image_max_tokens)]
    return argv


def shader_cache_dir(state_dir: Path) -> Path | None:
    """``<state_dir>/shader-cache``: made 0700 when it is not there; an existing one is
    used as it is (never chmod'ed) when it is a directory of this user, not a link. None
    (logged) when it cannot be: the engine then starts as Mesa would start it."""
    path = state_dir / SHADER_CACHE_DIR
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                log.warning(
                    "not using %s as the engine's shader cache: not a directory of this user "
                    "(every start compiles the GPU pipelines)",
                    path,
                )
                return None
        else:
            os.chmod(path, 0o700)  # made here: exactly 0700 whatever the umask
    except OSError as err:
        log.warning(
            "cannot make the engine's shader cache %s: %s (every start compiles the GPU pipelines)",
            path,
            err.strerror or err,
        )
        return None
    return path


def engine_env(
    cfg: EngineSettings, state_dir: Path, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What the engine's environment adds to the front's (``environ``, default
    ``os.environ``): :data:`ABORT_ENV` always; with a projector,
    :data:`slmguard.plan.projector.ENGINE_ENV` (glibc's
    mmap threshold fixed, so a large image request's buffers go back on free: the budget
    assumes it); for a Vulkan engine, ``MESA_SHADER_CACHE_DIR`` naming
    :func:`shader_cache_dir` (see the module docstring), unless the operator set one of
    :data:`MESA_CACHE_ENV`; nothing more for the others."""
    environ = os.environ if environ is None else environ
    vision = dict(VISION_ENV) if isinstance(cfg, EngineConfig) and cfg.mmproj else {}
    return {**ABORT_ENV, **vision, **_vulkan_env(cfg, state_dir, environ)}


def _vulkan_env(cfg: EngineSettings, state_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    if cfg.backend != "vulkan":
        return {}
    given = [name for name in MESA_CACHE_ENV if name in environ]
    if given:
        log.info("the engine's shader cache is the operator's (%s set)", ", ".join(given))
        return {}
    cache = shader_cache_dir(state_dir)
    return {} if cache is None else {"MESA_SHADER_CACHE_DIR": str(cache)}


def find_llama_server(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The engine binary: ``explicit`` (flag, environment or plan), else the build
    :mod:`slmguard.engines` selects for this CPU (the package's CPU profiles, the venv's,
    ``PATH``'s; ``slmguard engine`` shows the choice and why).

    Raises :class:`EngineUnavailableError` (exit 69) naming where it looked.
    """
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise EngineUnavailableError(
                f"the engine binary {path}",
                hint=f"{path} is not an executable file; pass --llama-server PATH to a "
                "llama-server build for this board",
            )
        return path
    selection = select_engine()
    log.info("engine %s: %s", selection.binary, selection.reason)
    return selection.binary


def check_backend(binary: Path, cfg: EngineSettings, timeout_s: float = 10.0) -> None:
    """Refuse (:class:`ConfigError`, exit 78) settings whose backend or device the binary
    does not list (each device's backend is :class:`slmguard.engines.Device`'s, from its
    name); a CPU plan needs nothing and is not asked about."""
    if cfg.backend == "cpu":
        return
    listed = list_devices(binary, timeout_s)
    devices = tuple(d.name for d in listed)
    wanted = cfg.device if cfg.device not in (None, "none") else None
    found = [d.name for d in listed if d.backend == cfg.backend]
    if found and (wanted is None or wanted in devices):
        return
    what = f"the {cfg.backend} backend"
    if found:
        what = f"device {wanted} of {what}"
    raise ConfigError(
        f"the plan's engine needs {what} (--device {cfg.device or 'default'}, --n-gpu-layers "
        f"{cfg.n_gpu_layers}) but {binary} lists "
        f"{', '.join(devices) or 'no device'} (`--list-devices`)",
        hint=f"plan again with `--gpu none` for this binary, or pass --llama-server PATH to a "
        f"llama-server built with {cfg.backend} (`make gpu-engine` builds Vulkan)"
        + ("; lavapipe needs GGML_VK_VISIBLE_DEVICES=0" if cfg.backend == "vulkan" else ""),
    )

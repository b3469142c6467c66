"""The engine worker: the only module that imports ``llama_cpp``.

Run as ``python -m slmguard.serve.worker --fd N --fault-log PATH
--oom-score-adj 1000`` by the supervisor, with one end of a socketpair as fd N
(see :mod:`slmguard.serve.protocol`). It owns one engine (model + context) and
runs one generation at a time; the front does all queueing.

Two threads: the main thread runs commands (load, generate) in order; a reader
thread receives frames and applies ``cancel`` at once (a set the token loop
checks before every token, so a cancelled or abandoned generation stops within
one token) and queues everything else. When the front goes away (end of
stream, or the parent dies: ``PR_SET_PDEATHSIG``) the worker exits.

The worker makes itself the kernel's preferred OOM victim by writing
``oom_score_adj`` (raising it never needs privileges), so an OOM kill takes the
engine, which the front restarts, rather than the front or the host's daemons.

Garbage: each llama-cpp-python generation leaves reference cycles whose
collection frees about 3 MiB (Gemma 3's 262,144-token vocabulary; measured).
Left to the generational collector they pile up to about 150 MiB before a
full collection runs, memory a board does not have. So the worker freezes
everything the engine holds after a load (:func:`gc.freeze`: later collections
skip it) and runs a full collection after every request, which then takes
about 0.1 ms instead of 9-12 ms (``benchmarks/worker_memory.py``). A reload
unfreezes first so the old engine's own cycles are collected too.
"""

from __future__ import annotations

import argparse
import codecs
import ctypes
import faulthandler
import gc
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slmguard.serve import protocol
from slmguard.serve.protocol import EngineConfig, Message

log = logging.getLogger("slmguard.worker")

_PR_SET_PDEATHSIG = 1
_KV_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type values


def set_oom_score_adj(value: int, root: Path = Path("/")) -> bool:
    """Write this process's oom_score_adj; False (logged) when not permitted."""
    try:
        (root / "proc/self/oom_score_adj").write_text(f"{value}\n")
    except OSError as err:
        log.warning("cannot set oom_score_adj to %d: %s", value, err.strerror)
        return False
    return True


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux/glibc: rely on end of stream
        log.debug("PR_SET_PDEATHSIG unavailable")


class StopScanner:
    """Hold back text that may be the start of a stop string.

    ``feed(text)`` returns ``(emit, stopped)``: the text that is safe to send
    now and whether a stop string was found (the stop string itself and
    anything after it are never emitted).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Engine:
    """llama-cpp-python behind the few calls the worker needs (CPU only)."""

    def __init__(self, cfg: EngineConfig) -> None:
        import llama_cpp

        self.cfg = cfg
        kv = _KV_TYPES[cfg.kv_type]
        self.llm = llama_cpp.Llama(
            model_path=cfg.model_path,
            n_gpu_layers=0,
            n_ctx=cfg.n_ctx,
            n_batch=cfg.n_batch,
            n_ubatch=cfg.n_ubatch,
            n_threads=cfg.n_threads,
            n_threads_batch=cfg.n_threads,
            use_mmap=cfg.use_mmap,
            use_mlock=cfg.use_mlock,
            type_k=kv,
            type_v=kv,
            # A quantized V cache needs flash attention in llama.cpp.
            flash_attn=cfg.kv_type != "f16",
            verbose=False,
        )
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._is_eog = llama_cpp.llama_vocab_is_eog

    @property
    def n_ctx(self) -> int:
        return int(self.llm.n_ctx())

    @property
    def n_vocab(self) -> int:
        return int(self.llm.n_vocab())

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return str(self.llm._model.token_get_text(token))

    @property
    def eos_token(self) -> str:
        return self.token_text(int(self.llm.token_eos()))

    def tokenize(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def tokenize_prompt(self, prompt: str | list[list[Any]], *, add_bos: bool,
                        special: bool) -> list[int]:  # fmt: skip
        """A prompt string, or segments ``[[text, special], ...]`` tokenized one by one."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_bos=add_bos, special=special)
        tokens: list[int] = []
        for i, (text, seg_special) in enumerate(prompt):
            tokens += self.tokenize(str(text), add_bos=add_bos and i == 0,
                                    special=bool(seg_special))  # fmt: skip
        return tokens

    def is_eog(self, token: int) -> bool:
        return bool(self._is_eog(self._vocab, token))

    def reset(self) -> None:
        self.llm.reset()  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self.llm.close()


def release_free_heap() -> bool:
    """Hand freed heap back to the kernel (glibc ``malloc_trim(0)``); False where absent.

    After a context resize the old context's host buffers are freed, but glibc
    may keep them in its arenas, so the worker's RSS (what the governor and the
    OOM killer see) would not drop. musl and other libcs lack the call.
    """
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


class Worker:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.engine: Engine | None = None
        self.commands: queue.Queue[Message | None] = queue.Queue()
        self.cancelled: set[int] = set()
        self.front_gone = threading.Event()

    def send(self, msg: Message) -> None:
        try:
            protocol.send_blocking(self.sock, msg)
        except OSError:
            self.front_gone.set()

    def read_loop(self) -> None:
        while True:
            try:
                msg = protocol.recv_blocking(self.sock)
            except (OSError, protocol.ProtocolError) as err:
                log.error("worker: reading from front failed: %s", err)
                msg = None
            if msg is None:
                self.front_gone.set()
                self.commands.put(None)
                return
            if msg["op"] == "cancel":
                self.cancelled.add(int(msg["id"]))
            else:
                self.commands.put(msg)

    def run(self) -> int:
        threading.Thread(target=self.read_loop, name="worker-reader", daemon=True).start()
        while True:
            msg = self.commands.get()
            if msg is None or msg["op"] == "shutdown" or self.front_gone.is_set():
                return 0
            op = msg["op"]
            if op == "load":
                self.load(EngineConfig.from_message(msg))
            elif op == "generate":
                self.generate(msg)
            elif op == "reset_cache":
                # Forget the cached prompt prefix: the next prompt is evaluated from
                # scratch (KV cells are reused; memory is only freed by a reload).
                if self.engine is not None:
                    self.engine.reset()
            else:
                log.error("worker: unknown op %r", op)

    def load(self, cfg: EngineConfig) -> None:
        started = time.monotonic()
        if self.engine is not None:
            # Reload (e.g. a smaller n_ctx from the governor): free the old context
            # first so the two never coexist in memory.
            self.engine.close()
            self.engine = None
            # llama_cpp.Llama holds reference cycles: without a collection its
            # Python-side buffers (a few MiB per reload, measured) outlive it.
            gc.unfreeze()
            gc.collect()
            release_free_heap()
        try:
            self.engine = Engine(cfg)
        except (ValueError, RuntimeError, OSError) as err:
            self.send({"op": "load_failed", "message": str(err)})
            return
        gc.collect()
        gc.freeze()
        self.send(
            {
                "op": "loaded",
                "n_ctx": self.engine.n_ctx,
                "n_vocab": self.engine.n_vocab,
                "eos_token": self.engine.eos_token,
                "pid": os.getpid(),
                "load_s": round(time.monotonic() - started, 3),
            }
        )

    def generate(self, msg: Message) -> None:
        rid = int(msg["id"])
        engine = self.engine
        if engine is None:
            self.send({"op": "error", "id": rid, "code": "engine_error", "message": "no engine"})
            return
        if rid in self.cancelled:
            self.cancelled.discard(rid)
            self.send({"op": "error", "id": rid, "code": "cancelled", "message": "cancelled"})
            return
        try:
            tokens = engine.tokenize_prompt(
                msg["prompt"], add_bos=bool(msg.get("add_bos", True)), special=bool(msg["special"])
            )
        except (RuntimeError, ValueError) as err:
            self.send({"op": "error", "id": rid, "code": "engine_error", "message": str(err)})
            return
        n_prompt, n_ctx = len(tokens), engine.n_ctx
        requested: int | None = msg.get("max_tokens")
        max_tokens = requested if requested is not None else n_ctx - n_prompt
        cap: int | None = msg.get("max_tokens_cap")
        if cap is not None:
            max_tokens = min(max_tokens, cap)
        if n_prompt == 0 or max_tokens <= 0 or n_prompt + max_tokens > n_ctx:
            self.send(
                {
                    "op": "error",
                    "id": rid,
                    "code": "context_length_exceeded",
                    "message": f"this model's context is {n_ctx} tokens; the prompt has "
                    f"{n_prompt} tokens and {max_tokens if max_tokens > 0 else 0} more were "
                    "requested for the completion",
                    "prompt_tokens": n_prompt,
                    "n_ctx": n_ctx,
                }
            )
            return
        self.send({"op": "start", "id": rid, "prompt_tokens": n_prompt, "max_tokens": max_tokens})
        finish, n_out = self._decode(engine, rid, tokens, max_tokens, msg)
        if finish == "cancelled":
            self.send(
                {"op": "error", "id": rid, "code": "cancelled", "message": "cancelled", "n": n_out}
            )
        elif finish.startswith("error:"):
            self.send({"op": "error", "id": rid, "code": "engine_error", "message": finish[6:]})
        else:
            self.send(
                {
                    "op": "done",
                    "id": rid,
                    "finish_reason": finish,
                    "prompt_tokens": n_prompt,
                    "completion_tokens": n_out,
                }
            )
        self.cancelled.discard(rid)
        # The request's cycles (see the module docstring), after its last
        # frame is sent: the client never waits for this.
        gc.collect()

    def _decode(
        self, engine: Engine, rid: int, tokens: list[int], max_tokens: int, msg: Message
    ) -> tuple[str, int]:
        llm = engine.llm
        temperature = float(msg.get("temperature", 1.0))
        if msg.get("seed") is not None:
            llm.set_seed(int(msg["seed"]))
        scanner = StopScanner(msg.get("stop") or [])
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out_tokens: list[int] = []
        finish = "length"
        hit_stop_string = False
        try:
            gen = llm.generate(
                tokens,
                temp=temperature,
                top_p=float(msg.get("top_p", 1.0)),
                top_k=int(msg.get("top_k", 0) or 0) if temperature > 0 else 1,
                min_p=0.0,
                repeat_penalty=1.0,
            )
            for token in gen:
                if rid in self.cancelled or self.front_gone.is_set():
                    finish = "cancelled"
                    break
                if engine.is_eog(token):
                    finish = "stop"
                    break
                piece = llm.detokenize([token], prev_tokens=tokens + out_tokens)
                out_tokens.append(token)
                text, stopped = scanner.feed(utf8.decode(piece))
                if text:
                    self.send({"op": "text", "id": rid, "text": text, "n": len(out_tokens)})
                if stopped:
                    finish = "stop"
                    hit_stop_string = True
                    break
                if len(out_tokens) >= max_tokens:
                    break
            gen.close()
        except (RuntimeError, ValueError) as err:
            return f"error:{err}", len(out_tokens)
        if finish != "cancelled" and not hit_stop_string:
            # End of sequence or max_tokens: release text held back as a possible
            # stop-string prefix, and any incomplete UTF-8 sequence (as U+FFFD).
            tail = scanner.flush() + utf8.decode(b"", final=True)
            if tail:
                self.send({"op": "text", "id": rid, "text": tail, "n": len(out_tokens)})
        return finish, len(out_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slmguard-worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--fault-log", type=Path, default=None)
    parser.add_argument("--oom-score-adj", type=int, default=1000)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
    )
    _die_with_parent()
    set_oom_score_adj(args.oom_score_adj)
    fault_file: Any = None
    if args.fault_log is not None:
        try:
            args.fault_log.parent.mkdir(parents=True, exist_ok=True)
            fault_file = args.fault_log.open("a")
            faulthandler.enable(file=fault_file)
        except OSError as err:
            log.warning("cannot open fault log %s: %s", args.fault_log, err.strerror)
            faulthandler.enable()
    # The front decides when the engine stops: a Ctrl-C in a terminal or systemd's
    # SIGTERM to the whole cgroup must not kill it under requests the front is
    # still draining. The front's exit (PR_SET_PDEATHSIG) or its shutdown message
    # ends the worker; SIGKILL still does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    return Worker(sock).run()


if __name__ == "__main__":
    sys.exit(main())

"""``slmguard serve``: an OpenAI-compatible server whose engine may die without taking it down.

Two processes. The *front* (this package minus ``worker``) owns HTTP, the
queue, metrics and the worker's life; it never imports ``llama_cpp``. The
*worker* (``python -m slmguard.serve.worker``) owns the engine and nothing
else, makes itself the OOM killer's preferred victim, and talks to the front
over a socketpair (``protocol``). When the worker dies, the front answers 503
(or an SSE error event), reports ``restarting`` and starts a new one with
backoff; too many deaths in a window and it exits non-zero for systemd.

Modules:
    protocol    frames and messages between front and worker
    worker      the engine process (the only importer of llama_cpp)
    supervisor  spawn, route messages, restart with backoff and a bounded rate
    admission   the engine slot and the bounded FIFO queue (429 when full)
    app         FastAPI app factory, routes, body limit, auth, SSE
    schemas     pydantic request/response models (the OpenAPI document)
    envelope    OpenAI error envelope for every error
    templates   chat templates (GGUF Jinja, else Gemma turns or ChatML)
    metrics     Prometheus metrics in the server's own registry
    procstat    RSS of the front and the worker from /proc/<pid>/status
    modelcheck  GGUF header check in a forked child (keeps the front small)
    hooks       the extension points below
    runner      process lifecycle: uvicorn, sd_notify, faulthandler, shutdown

Seams for the memory governor (``slmguard.governor``); all reached through
the :class:`~slmguard.serve.app.ServeContext` (``request.app.state.ctx``):

- admission: ``ctx.hooks.admission`` -- async callables taking an
  :class:`~slmguard.serve.hooks.AdmissionInfo`, called before a request is
  queued; raise :class:`~slmguard.serve.hooks.AdmissionRejected` (400/429/503,
  with Retry-After) to refuse it.
- max_tokens cap: ``ctx.hooks.max_tokens_caps`` -- callables returning a cap
  or None; the smallest cap (and ``--max-tokens-cap``) clamps every request;
  the context check (prompt + max_tokens <= n_ctx) runs after clamping.
- context size: ``await ctx.resize_context(n_ctx)`` (or ``reload_context``)
  waits for the running request, then recreates the engine with the new n_ctx
  inside the same worker process (old context freed first, then glibc's
  ``malloc_trim(0)`` so the freed heap leaves the RSS); if that fails the
  worker is killed and restarted by the supervisor.
- context verdict: ``ctx.hooks.context_verdict(prompt_tokens, max_tokens)``
  is asked when the engine refuses a prompt as too long; a returned
  ``AdmissionRejected`` (503 ``context_degraded``) replaces the plain 400.
- sessions: ``ctx.hooks.sessions`` (``session_prompt`` / ``record_turn``, the
  governor) serves chat requests carrying ``session_id`` or ``X-Session-Id``;
  None (``--no-governor``) answers them 400 ``sessions_unavailable``.
- abort: ``await ctx.abort_newest(reason)`` or ``ctx.supervisor.abort(id,
  reason)`` stops a generation before its next token; its client gets 503
  ``aborted``. ``ctx.supervisor.pending_ids()`` lists running generations.
- prefix cache: ``await ctx.drop_prefix_cache()``.
- memory: ``ctx.worker_pid()`` / ``ctx.supervisor.worker_pid`` for RSS
  sampling; ``ctx.degraded_reasons`` (name -> text) turns ``ready`` into
  ``degraded`` in /health.
- routes and health: ``ctx.hooks.routers`` (FastAPI routers mounted as-is,
  e.g. ``/api/v1/*``), ``ctx.hooks.health`` (dicts merged into /health
  ``extra``); ``ctx.metrics.registry`` takes extra collectors.

``slmguard.commands.serve`` builds the context, lets the governor install
itself into these hooks (``governor.serving.install``), and hands over to
``runner``.
"""

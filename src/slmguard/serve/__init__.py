"""``slmguard serve``: an OpenAI-compatible front guarding a llama-server child.

Two processes. The *front* (this package) owns HTTP, validation, the queue,
sessions, metrics, liveness and the engine's life. The *engine* is llama.cpp's
own ``llama-server``, started as a child on a private unix socket with a
per-start API key: it owns the model, its slots and continuous batching. When
the engine dies or wedges, the front answers 503 (or an SSE error event),
reports ``restarting`` or ``stalled`` and starts a new one with backoff; too
many deaths in a window and it exits non-zero for systemd.

Modules:
    llamaserver  the binary: where it is, its --version, its command line (pure)
    engine       the child's life: start, ready, restart with backoff and a budget,
                 reconfigure (fewer slots, smaller context), park and resume, logs
    upstream     the front's HTTP client to the child (transport errors translated)
    context      ServeContext (everything one server owns) and ServedModel
    queue        the engine's slots and the bounded FIFO in front of them (429)
    flights      the requests in flight: age, progress, abort
    relay        one generation: prepare (sessions, tokenize, cap, check), admit, relay
    slots        the engine's /slots, parsed and cached
    liveness     progress, not pings: stalls found, reported and replaced; the canary
    sessions     the SQLite conversation store and the server's use of it
    app          FastAPI app factory, routes, body limit, auth
    schemas      pydantic request/response models (the OpenAPI document)
    envelope     OpenAI error envelope for every error
    metrics      Prometheus metrics in the server's own registry, the engine's included
    modelcheck   GGUF header check in a forked child (keeps the front small)
    hooks        the extension points below
    runner       process lifecycle: uvicorn, sd_notify, faulthandler, shutdown

Seams for the memory governor (``slmguard.governor``), all reached through the
:class:`~slmguard.serve.context.ServeContext`:

- admission: ``ctx.hooks.admission`` -- async callables taking an
  :class:`~slmguard.serve.hooks.AdmissionInfo` (prompt tokens known), called
  before a request is queued; raise :class:`~slmguard.errors.OverloadedError`
  (503 with Retry-After) or :class:`~slmguard.errors.RequestTooLargeError`
  (400) to refuse it.
- max_tokens cap: ``ctx.hooks.max_tokens_caps`` -- callables returning a cap
  or None; the smallest cap (and ``--max-tokens-cap``) clamps every request;
  the context check (prompt + max_tokens <= a slot's context) runs after.
- the engine: ``ctx.engine`` (:class:`~slmguard.serve.engine.EngineProcess`:
  ``reconfigure``, ``park``, ``resume``, ``pid``), ``ctx.flights`` (abort the
  newest generation; its client gets 503 with the reason), ``ctx.queue``
  (wait for every slot before growing back), ``ctx.slots`` (erase idle slots);
  :class:`slmguard.governor.serving.ServeEngine` wraps them as the governor's
  ``EngineControl``.
- context verdict: ``ctx.hooks.context_verdict(prompt_tokens, max_tokens)`` is
  asked when a prompt does not fit a slot as it is now; a returned
  ``OverloadedError`` (503 ``context_degraded``) replaces the plain 400.
- sessions: ``ctx.sessions`` (the store the governor trims).
- routes and health: ``ctx.hooks.routers`` (FastAPI routers mounted as-is,
  e.g. ``/api/v1/*``), ``ctx.hooks.health`` (dicts merged into /health
  ``extra``); ``ctx.metrics.registry`` takes extra collectors;
  ``ctx.degraded_reasons`` (name -> text) turns ``ready`` into ``degraded``.

``slmguard.commands.serve`` builds the context, lets the governor install
itself into these hooks (``governor.serving.install``), and hands over to
``runner``.
"""

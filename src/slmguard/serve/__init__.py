"""``slmguard serve``: an OpenAI-compatible front guarding a llama-server child.

Two processes. The *front* (this package) owns HTTP, validation, the queue,
sessions, metrics, liveness and the engine's life. The *engine* is llama.cpp's
own ``llama-server``, started as a child on a private unix socket with a
per-start API key: it owns the model, its slots and continuous batching. When
the engine dies or wedges, the front answers 503 (or an SSE error event),
reports ``restarting`` or ``stalled`` and starts a new one with backoff; too
many deaths in a window and it exits non-zero for systemd.

Modules (the CLI composes the two halves: ``build_server(settings, plan)``,
then ``server.run(sock, create_app(server))``; the server never imports its app):

  the server's life and parts
    server       build_server(settings, plan=None) -> Server: every part built once,
                 with its callbacks; Server.run / serve: the life of one server, serving
                 the app it is given
    startup      what a server starts with, checked before anything starts: the plan
                 (made for this host without one), the engine's whole settings (Start)
    served       ServedModel: the model one engine serves, as routes and dialects see it
    modelengine  ModelEngine: one model's engine and every per-engine part (queue,
                 flights, slots, crash memory, liveness, bounds, control, relay, sizing,
                 dialects' context); Residency: how it is kept (pinned, on demand)
    models       ModelTable: the served models keyed by every name (404 otherwise)
    residency    on-demand models loaded when a request needs them (room made by the
                 policy, the wait bounded by the queue), unloaded when idle
    engine       the child's life: start, ready, restart with backoff and a budget,
                 reconfigure (fewer slots, smaller context), park and resume, logs
    llamaserver  the binary: where it is, its --version, its command line (pure)
    upstream     the front's HTTP client to the child (failures: EngineUnreachableError)
    http1        HTTP/1.1 framing on the wire to the child
    queue        the engine's slots and the bounded FIFO in front of them (429)
    flights      the requests in flight: age, progress, abort
    slots        the engine's /slots, parsed and cached
    liveness     progress, not pings: stalls found, reported and replaced; the canary
    control      the engine as the memory governor drives it (its EngineControl)
    recycle      a leaking engine drained, restarted and resumed without failing a request
    sessions     the SQLite conversation store and the server's use of it
    metrics      Prometheus metrics in the server's own registry, the engine's included
    modelcheck   GGUF header check and the plan for this host, in a forked child
    runner       the process around it: socket, uvicorn (httptools on uvloop),
                 sd_notify, fault log
  the HTTP layer (never imports server)
    app          create_app(server): body limit, envelope handlers, routers, OpenAPI
    parts        ServerParts: what the app holds and the routes read of the server
    routes       the HTTP routes, module-level routers (OpenAI /v1, tokenizer, health,
                 metrics, engine views, the governor's /api/v1)
    auth         the API key, the admin token: the one bearer check
    schemas      pydantic request/response models: the one validation edge (OpenAPI)
    labels       the fields that only label a request (no effect; plain data)
    bounds       what one request may make the engine do, checked on its JSON before
                 its schema; the requests the engine died running
    grammarstacks  llama.cpp's grammar parse stacks, simulated (ambiguity refused)
    images       an image's format and pixel size from its header, data URLs only, the
                 bounds (bytes, format, dimensions, images per request); pure
    envelope     the one mapping of errors to the OpenAI envelope (Anthropic's on
                 /v1/messages)
  a generation
    dialects/    chat, completions, responses, messages, rerank: each its prepare_*
                 (see its package docstring); context: what they are given
    sizing       the one max_tokens decision (pure)
    generation   Generation: the prepared request a dialect hands the relay
    relay        one engine's generations: admit, run, collect, record
    stream       one streamed generation relayed by one task, engine socket to client,
                 reaching the relay only through its seam (StreamOwner)
    gather       several choices of a non-stream request, gathered from the stream
    answers      the engine's answers read: JSON, its refusals, the usage it states

A generation's path, and where to extend it:

1. **A route** (:mod:`~slmguard.serve.routes`) takes ``dependencies=BOUNDED``
   (its JSON within :mod:`~slmguard.serve.bounds`), validates its body with its
   schema, checks what only it knows (the model name, token ids, a session
   id), then calls its dialect's ``prepare_*(server.dialects, ...)`` and
   the relay of the model the request names (``srv.models.get(name)``, held for
   the request by ``srv.residency.serving``). A new API is a new route, schema and
   dialect module ending in the same two calls; nothing after them changes.
2. **Prepare** (:mod:`~slmguard.serve.dialects`): the engine counts the prompt
   (each call watched by the relay), :class:`~slmguard.serve.sizing.Sizing`
   decides ``max_tokens``; a per-dialect rule (a request field, a control-token
   check) belongs in that dialect's module.
3. **The request policy** (:class:`~slmguard.governor.request.RequestPolicy`:
   the memory governor, or ``NoPolicy``) is asked at fixed points: its
   ``max_tokens_cap`` and ``context_verdict`` while sizing, its ``admit``
   before the queue. A new limit on requests is a rule of
   :mod:`slmguard.governor.policy` behind one of these three.
4. **Run** (:class:`~slmguard.serve.relay.Relay`): admitted into the slot
   queue, sent to the engine, the answer streamed or collected, usage counted,
   a session's turn recorded. The relay drives one engine; a server of several
   models (a board) has one :class:`~slmguard.serve.modelengine.ModelEngine`, with
   its own relay, per model.

Every refusal on the way is an error of :mod:`slmguard.errors`, raised, and
turned into the OpenAI envelope in one place (:mod:`~slmguard.serve.envelope`);
a new refusal is a class (or a ``code``) in that tree, with its row in
``ENVELOPES``. ``asyncio.wait_for`` timeouts are caught as
``asyncio.exceptions.TimeoutError``: on Python 3.10 it is not the builtin.
"""

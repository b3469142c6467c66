"""``slmguard serve``: an OpenAI-compatible front guarding a llama-server child.

Two processes. The *front* (this package) owns HTTP, validation, the queue,
sessions, metrics, liveness and the engine's life. The *engine* is llama.cpp's
own ``llama-server``, started as a child on a private unix socket with a
per-start API key: it owns the model, its slots and continuous batching. When
the engine dies or wedges, the front answers 503 (or an SSE error event),
reports ``restarting`` or ``stalled`` and starts a new one with backoff; too
many deaths in a window and it exits non-zero for systemd.

Modules:
    server       build_server(settings, plan) -> Server: every part built once, with
                 its callbacks; Server.run / Server.serve: the life of one server
    routes       the HTTP routes, module-level routers (OpenAI /v1, tokenizer, health,
                 metrics, engine views, the governor's /api/v1)
    auth         the API key, the admin token: the one bearer check
    schemas      pydantic request/response models: the one validation edge (OpenAPI)
    labels       the fields that only label a request (no effect; plain data, no pydantic)
    bounds       what one request may make the engine do (nesting, text, numbers that
                 size allocations, grammars, JSON schemas), checked on its JSON before
                 its schema; the requests the engine died running
    grammarstacks  the parse stacks llama.cpp's grammar sampler would check a token
                 against, simulated before the engine (ambiguous grammars refused)
    images       an image's format and pixel size from its header, data URLs only, the
                 bounds (bytes, format, dimensions, images per request); pure
    relay        one generation: prepare (sessions, tokenize, size), admit, relay
    stream       one streamed generation relayed by one task, engine socket to client
    answers      the engine's answers read: JSON, its refusals, the usage it states
    envelope     the one mapping of errors to the OpenAI envelope (Anthropic's shape
                 on /v1/messages)
    app          the FastAPI app: body limit, envelope handlers, routers, OpenAPI
    queue        the engine's slots and the bounded FIFO in front of them (429)
    flights      the requests in flight: age, progress, abort
    slots        the engine's /slots, parsed and cached
    liveness     progress, not pings: stalls found, reported and replaced; the canary
    sessions     the SQLite conversation store and the server's use of it
    metrics      Prometheus metrics in the server's own registry, the engine's included
    control      the engine as the memory governor drives it (its EngineControl)
    engine       the child's life: start, ready, restart with backoff and a budget,
                 reconfigure (fewer slots, smaller context), park and resume, logs
    llamaserver  the binary: where it is, its --version, its command line (pure)
    upstream     the front's HTTP client to the child (failures: EngineUnreachableError)
    http1        HTTP/1.1 framing on the wire to the child
    modelcheck   GGUF header check and the plan for this host, in a forked child
    runner       the process around it: socket, uvicorn (httptools on uvloop),
                 sd_notify, fault log

A generation's path, and where to extend it:

1. **A route** (:mod:`~slmguard.serve.routes`) takes ``dependencies=BOUNDED``
   (its JSON within :mod:`~slmguard.serve.bounds`), validates its body with its
   schema (:mod:`~slmguard.serve.schemas`: every field known, or 400 naming
   it), checks what only it knows (the model name, token ids, a session id),
   builds the engine's body and calls ``server.relay.prepare_chat``,
   ``prepare_completion``, ``prepare_responses``, ``prepare_messages`` or
   ``prepare_rerank``, then ``server.relay.run``. A new API (another
   request shape, a model alias) is a new route and schema that end in the
   same two calls; nothing after them changes.
2. **Prepare** (:class:`~slmguard.serve.relay.Relay`) tokenizes with the
   engine and sizes the request in :meth:`~slmguard.serve.relay.Relay.size`,
   the one place ``max_tokens`` is decided.
3. **The request policy** (:class:`~slmguard.governor.request.RequestPolicy`:
   the memory governor, or ``NoPolicy`` with ``--no-governor``) is asked at
   fixed points: its ``max_tokens_cap`` while sizing, its ``context_verdict``
   when the request does not fit one slot, its ``admit`` before the queue. A
   new limit on requests is a rule of :mod:`slmguard.governor.policy` behind
   one of these three.
4. **Admit and relay**: the slot queue, then the engine; the answer streams or
   comes whole.

Every refusal on the way is an error of :mod:`slmguard.errors`, raised, and
turned into the OpenAI envelope in one place (:mod:`~slmguard.serve.envelope`);
a new refusal is a class (or a ``code``) in that tree, with its row in
``ENVELOPES``. ``asyncio.wait_for`` timeouts are caught as
``asyncio.exceptions.TimeoutError``: on Python 3.10 it is not the builtin.
"""

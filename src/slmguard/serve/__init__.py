"""``slmguard serve``: an OpenAI-compatible front guarding a llama-server child.

The *front* (this package) owns HTTP, validation, the queue, sessions, metrics, liveness
and the engine's life; the *engine*, llama.cpp's ``llama-server``, is a child on a
private unix socket with a per-start key, and owns the model, its slots and batching.
The CLI composes the two halves (``build_server(settings, plan)``, then
``server.run(sock, create_app(server))``); the server never imports its app.

  the server's life and parts
    server       build_server(settings, plan=None) -> Server: every part built once;
                 Server.run / serve: the life of one server, serving the app it is given
    startup      what a server starts with, checked first: the plan, the engine's
                 whole settings (Start)
    served       ServedModel: the model one engine serves, as routes and dialects see it
    modelengine  ModelEngine: one model's engine and every per-engine part;
                 Residency: how it is kept (pinned, on demand)
    models       ModelTable: the served models keyed by every name (404 otherwise)
    residency    on-demand models loaded when a request needs them, unloaded when idle
    engine       the child's life: start, ready, restart with backoff and a budget,
                 reconfigure (fewer slots, smaller context), park and resume, logs
    readiness    when an engine on its way back is expected to serve: the Retry-After
                 of its 503s (backoff left + its last load time, bounded; pure)
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
    runner       the process around it: socket, uvicorn, sd_notify, fault log
  the HTTP layer (never imports server)
    app          create_app(server): body limit, envelope handlers, routers, OpenAPI
    parts        ServerParts: what the app holds and the routes read of the server
    routes       the HTTP routes (OpenAI /v1, tokenizer, health, metrics, engine views,
                 the governor's /api/v1)
    auth         the API key, the admin token: the one bearer check
    schemas      pydantic request/response models: the one validation edge (OpenAPI)
    labels       the fields that only label a request (no effect; plain data)
    bounds       what one request may make the engine do, checked on its JSON before
                 its schema; the requests the engine died running
    blame        the requests that made the engine fail and the clients that keep sending
                 them (429 client_cooldown)
    grammarstacks  llama.cpp's grammar parse stacks, simulated (ambiguity refused)
    images       an image's format and size from its header, data URLs only, the bounds
    vision       the projector one server serves: what a request's images may be and cost
    envelope     the one mapping of errors to the OpenAI (or Anthropic) envelope
  a generation
    dialects/    chat, completions, responses, messages, rerank: each its prepare_*;
                 context: what they are given
    rendered     every string of a request the chat template renders into the prompt
    sizing       the one max_tokens decision (pure)
    generation   Generation: the prepared request a dialect hands the relay
    relay        one engine's generations: admit, run, collect, record
    stream       one streamed generation relayed by one task, engine socket to client,
                 reaching the relay only through its seam (StreamOwner)
    gather       several choices of a non-stream request, gathered from the stream
    answers      the engine's answers read: JSON, its refusals, the usage it states

``docs/architecture.md`` (A request) draws a generation's path and where to extend it.
Every refusal is an error of :mod:`slmguard.errors`, mapped once
(:mod:`~slmguard.serve.envelope`). Catch ``asyncio.wait_for`` timeouts as
``asyncio.exceptions.TimeoutError``: on Python 3.10 it is not the builtin.
"""

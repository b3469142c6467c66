"""The request shapes the front speaks, each made ready for the engine by its own module.

One module per dialect, each with its ``prepare_*`` (a validated request in, a
sized :class:`~slmguard.serve.generation.Generation` out) and whatever belongs
to that dialect alone:

    chat         /v1/chat/completions: sessions, the template's exact count
    completions  /v1/completions: every prompt form, n choices per prompt
    responses    /v1/responses: labels, text.format, the engine's input count
    messages     /v1/messages (and count_tokens): Anthropic's tool_choice
    rerank       /v1/rerank: (query, document) pairs, one batch on an encoder
    context      what every dialect is given (the engine's counts, the sizing,
                 the model, the sessions) and the control-token check they share

Dialects never import each other nor the relay; a new request shape (or a fix to
one) is a change here and in its route and schema, nowhere after ``prepare_*``.
"""

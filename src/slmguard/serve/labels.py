"""The request fields that only label a request: accepted, never sent to the engine,
documented as having no effect (docs/serve.md). Plain data, importable without the web
stack: the relay reads them, the schemas declare them."""

from __future__ import annotations

#: OpenAI's fields that only label a request (``store`` only as false: the schema refuses
#: ``store: true``, which asks the server to keep the completion).
LABEL_FIELDS = frozenset({
    "user", "metadata", "service_tier", "store", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "moderation",
})  # fmt: skip

#: Anthropic's fields that only label a request (accepted, not sent to the engine).
ANTHROPIC_LABEL_FIELDS = frozenset({
    "metadata", "service_tier", "inference_geo", "speed", "user_profile_id", "workspace_id",
    "cache_control", "diagnostics",
})  # fmt: skip

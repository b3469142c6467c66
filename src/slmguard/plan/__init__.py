"""The plan family: from a GGUF header and a board to the versioned plan every verb reads.

A plan flows GGUF -> facts -> budget -> plan: ``modelfacts`` reads the model's
header (never the weights), ``presets`` and ``boards`` name known models and
boards, ``budget`` is the memory arithmetic, ``planner`` makes the choices with
their reasons, ``schema`` is the plan file (``--plan``) and ``inputs`` resolves
the CLI's choices. It reads the host only through ``slmguard.host`` and knows
nothing of the server, the watcher, the audit or the deployment.
"""

"""The CLI verbs, one module each: ``register(subparsers)`` and ``run(args) -> int``.

Modules here may print; they import heavy dependencies inside ``run`` only.
"""

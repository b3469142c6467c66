"""slmguard: keep small language models alive in production on small boards.

The package is a library first; ``slmguard.cli`` is the thin shell over it and
the only place that prints or exits. Heavy dependencies (the engine, the web
stack) are imported only by the modules that use them.
"""

__version__ = "0.1.0"

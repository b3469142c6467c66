"""Host readers: pure parsers of kernel files plus thin readers taking a root path.

Every reader takes ``root`` (default ``Path("/")``) and reads ``root/proc/...``,
``root/sys/...``, so tests point them at a materialized fixture tree. Parsers take
text and return frozen snapshots (units in field names, ``None`` where the
kernel did not say). Readers translate OS errors into
:class:`slmguard.errors.HostReadError` at the edge. Nothing here writes, but for
:func:`slmguard.host.process.set_oom_score_adj` (this process's own OOM priority).
"""

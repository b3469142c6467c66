"""Listen addresses: the one rule for "is this address loopback?".

Owns :func:`is_loopback`, used by ``serve`` (a non-loopback listener needs an
API key), the doctor's ``unit.bind`` check (a public address without a key)
and ``top`` (it reads the host's files only when the server is on this
machine), so the three never disagree about an address. Pure.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True for a loopback address (``127.0.0.0/8``, ``::1``, bracketed or not) or name.

    Any other name is not: it may resolve to a reachable address.

    Example::

        is_loopback("127.0.0.2"), is_loopback("[::1]"), is_loopback("0.0.0.0")
        # (True, True, False)
    """
    h = host.strip().strip("[]")
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False

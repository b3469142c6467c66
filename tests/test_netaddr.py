"""netaddr.is_loopback: the one loopback rule serve, doctor and top share."""

from __future__ import annotations

import pytest

from slmguard.doctor.bind import is_public
from slmguard.netaddr import is_loopback
from slmguard.top.sources import is_loopback_url


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("ip6-localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.20", False),
        ("board.local", False),  # a name may resolve anywhere
        ("", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    # The doctor's "public" is the same rule (plus unix sockets, never public).
    assert is_public(host) is not loopback


def test_the_three_users_agree() -> None:
    assert is_loopback_url("http://[::1]:8080") and not is_loopback_url("http://10.0.0.1:8080")
    assert not is_public("/run/slmguard/engine.sock") and not is_public("unix:/run/x.sock")

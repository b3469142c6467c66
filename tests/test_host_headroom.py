"""host.headroom: the effective limit, how full, the adaptive interval (governor and watch)."""

from __future__ import annotations

import pytest

from slmguard.host.headroom import effective_limit, headroom_bytes, poll_interval_s, used_pct

MIB = 1 << 20


def test_effective_limit_ignores_unset_and_zero() -> None:
    assert effective_limit([(None, "a"), (0, "b"), (5, "c"), (3, "d"), (3, "e")]) == (3, "d")
    assert effective_limit([(None, "a")]) == (None, None)


def test_used_pct_and_headroom() -> None:
    assert used_pct(850 * MIB, 1000 * MIB) == 85.0
    assert used_pct(None, 1000 * MIB) is None
    assert used_pct(850 * MIB, None) is None and used_pct(850 * MIB, 0) is None
    assert headroom_bytes(850 * MIB, 1000 * MIB) == 150 * MIB
    assert headroom_bytes(1100 * MIB, 1000 * MIB) == -100 * MIB  # over the limit
    assert headroom_bytes(850 * MIB, None) is None


KW = {"fill_rate_bytes_per_s": 100 * MIB, "min_s": 0.5, "max_s": 5.0}


@pytest.mark.parametrize(
    ("ws_mib", "lines", "looks", "expected_s"),
    [
        (100, (), 1.0, 5.0),  # 900 MiB to the limit at 100 MiB/s: 9 s, capped
        (100, (), 4.0, 2.25),  # four looks before the limit
        (100, (85.0,), 1.0, 5.0),  # 750 MiB to the 85% line: 7.5 s, capped
        (700, (85.0,), 1.0, 1.5),  # 150 MiB to the line
        (900, (85.0,), 1.0, 1.0),  # above every line: the limit is next
        (990, (), 1.0, 0.5),  # 10 MiB: floor at min
        (1000, (), 1.0, 0.5),  # at the limit
        (1100, (), 4.0, 0.5),  # over it
    ],
)
def test_poll_interval(
    ws_mib: int, lines: tuple[float, ...], looks: float, expected_s: float
) -> None:
    got = poll_interval_s(ws_mib * MIB, 1000 * MIB, lines_pct=lines, looks_per_crossing=looks, **KW)
    assert got == pytest.approx(expected_s)


def test_poll_interval_without_limit_or_fill_is_the_longest() -> None:
    assert poll_interval_s(100 * MIB, None, **KW) == 5.0
    assert poll_interval_s(100 * MIB, 0, **KW) == 5.0
    still = {**KW, "fill_rate_bytes_per_s": 0.0}
    assert poll_interval_s(900 * MIB, 1000 * MIB, **still) == 5.0  # not filling
    shrinking = {**KW, "fill_rate_bytes_per_s": -50.0 * MIB}
    assert poll_interval_s(900 * MIB, 1000 * MIB, **shrinking) == 5.0

"""Link rates and delays as people write them (swarm.rates)."""

from __future__ import annotations

import pytest

from swarm.rates import format_rate, parse_delay, parse_rate


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("100mbit", 100_000_000),
        ("10Mbit", 10_000_000),
        ("1gbit", 10**9),
        ("500kbit", 500_000),
        ("1.5mbit", 1_500_000),
        ("64kibit", 65536),
        (" 20 MBIT ", 20_000_000),
        (5e6, 5_000_000),
        (123, 123),
        ("100", 100),  # a bare number is bits/s
    ],
)
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "fast",
        "-5mbit",
        "0mbit",
        "10mbps",
        "10MB/s",
        "1e400mbit",
        "mbit",
        "10 m bit s",
        "nan",
        True,
        float("inf"),
        0,
    ],
)
def test_bad_rate_is_one_clear_line(bad):
    with pytest.raises(ValueError) as info:
        parse_rate(bad)
    message = str(info.value)
    assert "\n" not in message and "rate" in message and len(message) < 200


def test_delay_and_format():
    assert parse_delay("20ms") == pytest.approx(0.02)
    assert parse_delay("0.5s") == 0.5 and parse_delay("100us") == pytest.approx(1e-4) and parse_delay(None) == 0.0
    for bad in ("soon", "-1ms", "2min", "99s"):
        with pytest.raises(ValueError, match="bad delay"):
            parse_delay(bad)
    assert format_rate(20_000_000) == "20mbit" and format_rate(1_500_000) == "1.5mbit" and format_rate(500) == "500bit"

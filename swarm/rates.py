"""Link rates and delays as people write them: '100mbit', '500kbit', '1gbit'; '20ms', '0.5s'.

Rates follow tc's decimal bit units (1mbit = 10**6 bits/s), so a string means the same thing here
and on a `tc` command line. Byte-per-second forms ('100mbps', '10MB/s') are refused on purpose:
in tc 'mbps' means megaBYTES per second while most people mean megabits, and a factor of 8 in a
benchmark's bound is too easy to miss.

    parse_rate('100mbit') == 100_000_000      parse_rate(5e6) == 5_000_000
    parse_delay('20ms') == 0.02               parse_delay(0.02) == 0.02
    format_rate(20_000_000) == '20mbit'

Every bad value raises ValueError with a one-line message that names the value and the valid forms.
"""

from __future__ import annotations

import math
import re

_RATE_UNITS = {
    "": 1,
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
}
_DELAY_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
RATE_FORMS = "a number of bits/s or NUMBER with bit, kbit, mbit, gbit, tbit (or kibit, mibit, gibit), e.g. 100mbit, 500kbit, 1gbit"
DELAY_FORMS = "seconds as a number or NUMBER with s, ms, us, e.g. 20ms, 0.5s"


def _amount(value, kind: str, units: dict[str, float], forms: str) -> float:
    """A number as is, or NUMBER+UNIT from `units` scaled; bad input is a one-line ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"bad {kind} {value!r}: expected {forms}")
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip().lower().replace(" ", "")
    if kind == "rate" and re.fullmatch(r".*(bps|b/s|byte.*)", text):
        raise ValueError(
            f"bad rate {value!r}: byte-based units are ambiguous (tc reads 'mbps' as megabytes/s); write bits, e.g. 100mbit"
        )
    match = re.fullmatch(rf"({_NUMBER})([a-z]*)", text)
    if not match or match.group(3) not in units:
        raise ValueError(f"bad {kind} {value!r}: expected {forms}")
    return float(match.group(1)) * units[match.group(3)]


def parse_rate(value: str | int | float) -> int:
    """Bits per second from '100mbit', '10Mbit', '1gbit', '500kbit', '1.5mbit' or a number (bits/s); > 0."""
    bits = _amount(value, "rate", _RATE_UNITS, RATE_FORMS)
    if not math.isfinite(bits) or bits < 1:
        raise ValueError(f"bad rate {value!r}: must be a finite rate of at least 1 bit/s")
    return int(round(bits))


def parse_delay(value: str | int | float | None) -> float:
    """Seconds from '20ms', '0.5s', '100us' or a number of seconds; None and 0 mean no delay."""
    if value is None:
        return 0.0
    seconds = _amount(value, "delay", _DELAY_UNITS, DELAY_FORMS)
    if not math.isfinite(seconds) or seconds < 0 or seconds > 60:
        raise ValueError(f"bad delay {value!r}: must be between 0 and 60 seconds")
    return seconds


def format_rate(bits_per_s: float) -> str:
    """The shortest decimal tc-style spelling: 20_000_000 -> '20mbit', 1_500_000 -> '1.5mbit'."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.6g}{unit}"
    return f"{bits_per_s:.6g}bit"


def format_delay(seconds: float) -> str:
    """tc-style: 0.02 -> '20ms', 0.0005 -> '500us'."""
    if seconds >= 1:
        return f"{seconds:.6g}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.6g}ms"
    return f"{seconds * 1e6:.6g}us"

"""The lab's `--bandwidth`: one rate for every process ('100mbit'), rates per process
('stage1=20mbit,*=100mbit') or a YAML file of {process: rate}. Every rate is checked here, so a
typo is a one-line error before any process starts."""

from __future__ import annotations

from pathlib import Path

import yaml

from swarm.config.messages import yaml_problem
from swarm.rates import parse_rate


def _rate_file(path: Path) -> dict[str, str]:
    """A YAML (or JSON) file of {process: rate}, or a one-line error naming it."""
    try:
        table = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--bandwidth file {path} is not readable YAML: {yaml_problem(e)}") from None
    if not isinstance(table, dict):
        raise ValueError(f"--bandwidth file {path} must map process names to rates")
    return {str(k): str(v) for k, v in table.items()}


def parse_rates(text: str | None, names: list[str]) -> dict[str, str] | None:
    """{process: rate} of the processes `--bandwidth` gives a rate (None without the option);
    processes: bootstrap, stage0.., trainer; '*' stands for the ones not named."""
    if text is None:
        return None
    if Path(text).is_file():
        table = _rate_file(Path(text))
    elif text.endswith((".yaml", ".yml", ".json")) or "/" in text:  # no rate looks like a path
        raise ValueError(f"--bandwidth file {text} does not exist")
    elif "=" in text:
        table = {}
        for item in text.split(","):
            name, _, rate = item.partition("=")
            if not rate:
                raise ValueError(f"--bandwidth item {item!r}: write NAME=RATE")
            table[name.strip()] = rate.strip()
    else:
        table = {"*": text}
    unknown = sorted(set(table) - {*names, "*"})
    if unknown:
        raise ValueError(
            f"--bandwidth names unknown process(es) {', '.join(unknown)} (processes: {', '.join(names)}, or * for the rest)"
        )
    rates = {name: table.get(name, table.get("*")) for name in names}
    for rate in rates.values():
        if rate is not None:
            parse_rate(rate)
    return {name: rate for name, rate in rates.items() if rate is not None}

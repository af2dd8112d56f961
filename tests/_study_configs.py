"""Tiny study configs (a 3-stage MLP on 160 digits) for the tests of `swarm study` and `swarm report`."""

from __future__ import annotations

from pathlib import Path

TINY = """\
name: {name}
seed: 0
model: {{name: digits_mlp, num_stages: 3}}
data: {{name: digits, options: {{train_size: 160}}}}
optimizer: {{name: sgd, lr: 0.1, schedule: cosine}}
train: {{epochs: {epochs}, batch_size: 40, micro_batches: 2, eval_batch_size: 400, eval_every: 1}}
compression: {{forward: '{fw}', backward: '{bw}'}}
report: {{table: 'Table 2: TopK', row: {row}{paper}}}
"""


def write_tiny_configs(directory: Path, rows: list[tuple], epochs: int = 3) -> Path:
    """rows: (name, forward, backward) or (name, forward, backward, row label, paper off, paper on)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, fw, bw, *shown in rows:
        row, paper = (shown[0], f", paper: {{acc_off: {shown[1]}, acc_on: {shown[2]}}}") if shown else (name, "")
        text = TINY.format(name=name, fw=fw, bw=bw, row=row, paper=paper, epochs=epochs)
        (directory / f"{name}.yaml").write_text(text)
    return directory

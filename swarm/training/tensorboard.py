"""A run's TensorBoard event files, written from its results rows (`ResultsWriter.listeners`), so
every scalar is one of the results JSONL's, at the step the row names:

- train/loss, train/lr, train/epoch: the step row's;
- train/samples_per_s: the samples of the step over its seconds (its row's `samples` and `time_s`
  less the row before's);
- bytes/<link> (<codec>): each link direction's bytes of the step (`bytes`), named with the codec
  it ran (the config's, or the step's `codecs` under adaptive compression);
- eval/<uncompressed|compressed>/<metric>: the evaluation rows' metrics;
- the config, and each sample (`train.sample_every`), as text.

A run that goes back to the swarm's copies writes the replayed steps again: TensorBoard keeps the
newest values of a step (it drops what follows a step written again).
"""

from __future__ import annotations

import json

from swarm.config import ExperimentConfig


def _summary_writer(directory: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(log_dir=str(directory))


class TensorBoardRows:
    """Writes the rows it observes into event files under `directory`."""

    def __init__(self, directory: str) -> None:
        self.writer = _summary_writer(directory)
        self.codecs: dict[int, tuple[str, str]] = {}  # boundary -> (forward, backward) specs
        self.seen: dict[int, tuple[int, float]] = {0: (0, 0.0)}  # step -> its row's (samples, time_s)

    def observe(self, row: dict) -> None:
        kind = row.get("type")
        if kind == "config":
            self._config(row)
        elif kind == "step":
            self._step(row)
        elif kind == "eval":
            for mode in ("uncompressed", "compressed"):
                for metric, value in row.get(mode, {}).items():
                    self.writer.add_scalar(f"eval/{mode}/{metric}", value, row["step"])
            self.writer.flush()
        elif kind == "sample":
            text = f"{row['prompt']} ⟶ {row['text']}"
            self.writer.add_text("sample", text, row["step"])
        elif kind == "rewind":  # the next step row follows the row of this step
            self.seen = {step: seen for step, seen in self.seen.items() if step <= row["step"]}

    def _config(self, row: dict) -> None:
        cfg = ExperimentConfig.model_validate(row["config"])
        self.codecs = {}
        for boundary in range(cfg.model.num_stages - 1):
            link = cfg.compression.link(boundary)
            self.codecs[boundary] = (link.forward, link.backward)
        self.writer.add_text("config", f"```\n{json.dumps(row['config'], indent=1)}\n```", 0)

    def _step(self, row: dict) -> None:
        step = row["step"]
        for name in ("loss", "lr", "epoch"):
            self.writer.add_scalar(f"train/{name}", row[name], step)
        samples, seconds = row["samples"], row["time_s"]
        before_samples, before_seconds = self.seen[max(self.seen)]  # the row before, in the results
        if seconds > before_seconds:
            self.writer.add_scalar("train/samples_per_s", (samples - before_samples) / (seconds - before_seconds), step)
        self.seen[step] = (samples, seconds)
        ran = {int(b): tuple(specs) for b, specs in row.get("codecs", {}).items()} or self.codecs
        for link, count in row.get("bytes", {}).items():
            self.writer.add_scalar(f"bytes/{link.removesuffix('.train')}{_codec(ran, link)}", count, step)

    def close(self) -> None:
        self.writer.close()


def _codec(codecs: dict[int, tuple[str, str]], link: str) -> str:
    """' (<spec>)' of a link `boundary<i>.<direction>[.train]`, or '' when not known."""
    boundary, _, rest = link.removeprefix("boundary").partition(".")
    specs = codecs.get(int(boundary)) if boundary.isdigit() else None
    direction = rest.split(".")[0]
    if specs is None or direction not in ("forward", "backward"):
        return ""
    return f" ({specs[0] if direction == 'forward' else specs[1]})"

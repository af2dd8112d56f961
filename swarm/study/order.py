"""Which rows of a study settle the paper's findings, and the order a study runs its seeds in.

The rows a finding compares are found the way the findings find them (swarm.study.findings looks
rows up by what they run): every check runs once over the study's configs as if all had finished,
and the rows it looked up are the ones it needs. Those run at every seed asked for; a row no
finding compares runs once (seed 0): it is only illustrative. Order: seed 0 of every settling row
(baselines first, then in the order the findings use them), then seed 1 of each, and so on, then
the illustrative rows; so a study stopped at any point has as many seeds as it can of every row
the findings need.
"""

from __future__ import annotations

from swarm.study.entries import Entry
from swarm.study.findings import CHECKS
from swarm.study.rows import Row, Study


class _RecordingStudy(Study):
    """A Study that remembers every row a check looked up."""

    def __init__(self, rows: list[Row]) -> None:
        super().__init__(rows)
        self.used: list[str] = []

    def find(self, model, pred):
        row = super().find(model, pred)
        if row is not None and row.name not in self.used:
            self.used.append(row.name)
        return row


def _as_finished(entry: Entry) -> Row:
    """A placeholder row with measurements, so every check looks up every row it compares."""
    cfg = entry.cfg
    comp = cfg.compression
    zero = {"acc_off": 0.0, "acc_on": 0.0, "loss_off": 0.0, "loss_on": 0.0}
    return Row(entry.row, cfg.model.name, comp.forward, comp.backward, cfg.train.warmup_epochs, True, **zero)


def settling_rows(entries: list[Entry]) -> list[str]:
    """Names of the rows the findings compare: uncompressed baselines first, then in the order used."""
    firsts = {e.row: e for e in entries if e.cfg is not None and e.replicate == 0}
    study = _RecordingStudy([_as_finished(e) for e in firsts.values()])
    for check in CHECKS:
        check(study)
    baselines = [
        name
        for name in study.used
        if firsts[name].cfg.compression.forward == "none" and firsts[name].cfg.compression.backward == "none"
    ]
    return baselines + [name for name in study.used if name not in baselines]


def plan(entries: list[Entry], every_row: bool = False) -> list[Entry]:
    """The runs a study makes, in the order it makes them (see the module's docstring);
    `every_row`: the rows no finding compares run at every seed too (after the others)."""
    rank = {name: i for i, name in enumerate(settling_rows(entries))}
    kept = [e for e in entries if e.row in rank or e.replicate == 0 or every_row]

    def order(entry: Entry) -> tuple:
        if entry.row in rank:
            return (0, entry.replicate, rank[entry.row], "")
        return (1, entry.replicate, 0, entry.row)

    return sorted(kept, key=order)

"""The paper's findings, checked against a study's measured rows.

Each check names the claim, what the paper measured, and what we measured, and gives a verdict
from our numbers only: `holds`, `does not hold`, `mixed` (some rows agree, some do not, or the
difference is within noise), or `pending` (the rows it needs have not finished). Rows are found by
what they run (codec specs, warmup, model), not by file name, so any study shaped like the
paper's tables can be checked.

Accuracies are percentages; a difference counts only when it exceeds `MARGIN` points: one seed
and a 2,000-image test set cannot resolve less (the binomial standard error alone is ~1 point).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MARGIN = 2.0  # accuracy points a difference must exceed to count
LOSS_MARGIN = 0.1  # nats, for the language model


@dataclass
class Row:
    """One run as the checks see it (built by swarm.study.runs.as_row from a results file or a pending config)."""

    name: str
    model: str  # resnet18 | gpt2 | ...
    forward: str
    backward: str
    warmup: float = 0.0  # epochs uncompressed first
    finished: bool = False
    acc_off: float | None = None  # best test accuracy (%), compression off at inference
    acc_on: float | None = None  # ... and on
    loss_off: float | None = None  # final eval loss (language models)
    loss_on: float | None = None
    paper: dict[str, float] = field(default_factory=dict)


@dataclass
class Finding:
    title: str
    table: str
    paper: str  # what the paper measured
    verdict: str  # holds | does not hold | mixed | pending
    ours: str  # what we measured (or what is missing)


_TOPK = re.compile(r"^topk:([0-9.]+)(?:/[a-z0-9]+)?(?:\+([a-z0-9]+)(?:/[a-z0-9]+)?)?$")
_QUANT = re.compile(r"^quant:(\d+)(?:/[a-z]+)*$")


def _topk(spec: str) -> tuple[float, str | None] | None:
    m = _TOPK.match(spec)
    return (float(m.group(1)), m.group(2)) if m else None


def _bits(spec: str) -> int | None:
    m = _QUANT.match(spec)
    return int(m.group(1)) if m else None


def _pct(ratio: float) -> str:
    return f"Top{100 * ratio:g}%"


def _signed(value: float, unit: str = "") -> str:
    return f"{value:+.2f}{unit}"


class Study:
    """Lookups over a study's rows."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def find(self, model: str, pred) -> Row | None:
        return next((r for r in self.rows if r.model == model and pred(r)), None)

    def baseline(self, model: str) -> Row | None:
        return self.find(model, lambda r: r.forward == "none" and r.backward == "none")

    def quant(self, fw: int, bw: int) -> Row | None:
        return self.find("resnet18", lambda r: (_bits(r.forward), _bits(r.backward)) == (fw, bw))

    def topk(
        self,
        ratio: float,
        model: str = "resnet18",
        feedback: str | None = None,
        warmup: bool = False,
        backward: str | None = None,
    ) -> Row | None:
        def pred(r: Row) -> bool:
            fw = _topk(r.forward)
            if fw is None or fw[0] != ratio or fw[1] != feedback or bool(r.warmup) != warmup:
                return False
            if backward is not None:
                return r.backward == backward
            bw = _topk(r.backward)
            return bw is not None and bw[0] == ratio and (feedback == "aqsgd" or bw[1] == feedback)

        return self.find(model, pred)


def _missing(rows: list[tuple[str, Row | None]]) -> list[str]:
    return [label for label, row in rows if row is None or not row.finished]


def _pending(title: str, table: str, paper: str, missing: list[str]) -> Finding:
    return Finding(title, table, paper, "pending", "waiting for " + ", ".join(missing))


def _found(title: str, table: str, paper: str, verdict: str, ours: str, missing: list[str]) -> Finding:
    """A verdict from the rows measured so far; names the rows still missing."""
    if missing:
        verdict += " (so far)"
        ours += f"; pending: {', '.join(missing)}"
    return Finding(title, table, paper, verdict, ours)


def _combine(support: int, contradict: int, total: int) -> str:
    if total and support == total:
        return "holds"
    if total and contradict == total:
        return "does not hold"
    return "mixed"


def gradients_more_sensitive(study: Study) -> Finding:
    """Table 1: at an equal bit budget, giving the bits to the gradients wins."""
    title, table = "Gradients are more sensitive to compression than activations", "Table 1"
    pairs = [((4, 2), (2, 4)), ((4, 4), (2, 6)), ((4, 6), (2, 8))]
    paper = "at equal total bits the gradient-heavy split wins with compressed inference: fw2-bw4 83.92 vs fw4-bw2 64.27, fw2-bw6 91.59 vs fw4-bw4 82.66, fw2-bw8 92.05 vs fw4-bw6 91.76"
    rows = [(f"fw{a}-bw{b}", study.quant(a, b)) for pair in pairs for a, b in pair]
    missing = _missing(rows)
    done = [(study.quant(*fwh), study.quant(*bwh), fwh, bwh) for fwh, bwh in pairs]
    done = [d for d in done if d[0] and d[1] and d[0].finished and d[1].finished]
    if not done:
        return _pending(title, table, paper, missing)
    support = contradict = 0
    parts = []
    for fw_heavy, bw_heavy, (a, b), (c, d) in done:
        diff = bw_heavy.acc_on - fw_heavy.acc_on
        support += diff > MARGIN
        contradict += diff < -MARGIN
        parts.append(f"fw{c}-bw{d} {bw_heavy.acc_on:.2f} vs fw{a}-bw{b} {fw_heavy.acc_on:.2f} ({_signed(diff)})")
    # holds: the gradient-heavy split is clearly better at least once and never clearly worse
    verdict = "does not hold" if support == 0 else ("holds" if contradict == 0 else "mixed")
    return _found(
        title,
        table,
        paper,
        verdict,
        "; ".join(parts) + f" (the check: better by more than {MARGIN:g} points at least once, never worse by that)",
        missing,
    )


TOPK_LEVELS = (0.5, 0.3, 0.2, 0.1, 0.05, 0.02)


def strongest_safe_topk(study: Study) -> Finding:
    """Table 2: the smallest K whose compressed-inference accuracy stays within MARGIN of the baseline."""
    title, table = "Top10% is the strongest TopK that stays close to the baseline", "Table 2"
    paper = "compressed-inference accuracy within 2 points of the baseline (93.00) down to Top10% (91.87); Top5% 90.01, Top2% 85.52"
    base = study.baseline("resnet18")
    rows = [(_pct(k), study.topk(k)) for k in TOPK_LEVELS]
    missing = _missing([("baseline", base), *rows])
    if base is None or not base.finished or missing:
        return _pending(title, table, paper, missing)
    safe = [k for k, (_, r) in zip(TOPK_LEVELS, rows, strict=True) if r.acc_on >= base.acc_on - MARGIN]
    strongest = None
    for k, (_, r) in zip(TOPK_LEVELS, rows, strict=True):  # every level down to K safe
        if r.acc_on < base.acc_on - MARGIN:
            break
        strongest = k
    drops = ", ".join(f"{label} {_signed(r.acc_on - base.acc_on)}" for label, r in rows)
    ours = f"vs the baseline ({base.acc_on:.2f}): {drops}; "
    ours += (
        f"strongest level with every larger one within {MARGIN:g} points: {_pct(strongest) if strongest else 'none'}"
    )
    if set(safe) != {k for k in TOPK_LEVELS if strongest and k >= strongest}:
        ours += f" (within the margin at all: {', '.join(_pct(k) for k in safe) or 'none'})"
    verdict = "holds" if strongest == 0.1 else "does not hold"
    return Finding(title, table, paper, verdict, ours)


def topk_needs_compressed_inference(study: Study) -> Finding:
    """Table 2: a model trained with TopK is better evaluated with TopK on (gap grows as K shrinks)."""
    title, table = "A model trained with TopK needs compressed inference", "Table 2"
    paper = "accuracy on minus off: Top50% +0.22, Top30% +1.80, Top20% +5.99, Top10% +15.98, Top5% +34.92, Top2% +35.57"
    rows = [(_pct(k), study.topk(k)) for k in TOPK_LEVELS]
    missing = _missing(rows)
    done = [(label, r) for label, r in rows if r and r.finished]
    strong = [(label, r) for (label, r), k in zip(rows, TOPK_LEVELS, strict=True) if k <= 0.2 and r and r.finished]
    if not strong:
        return _pending(title, table, paper, missing or ["Top20% and below"])
    gaps = ", ".join(f"{label} {_signed(r.acc_on - r.acc_off)}" for label, r in done)
    support = sum(r.acc_on - r.acc_off > MARGIN for _, r in strong)
    verdict = "holds" if support == len(strong) else ("does not hold" if support == 0 else "mixed")
    ours = (
        f"accuracy on minus off: {gaps} (the check: every level at or below Top20% gains more than {MARGIN:g} points)"
    )
    return _found(title, table, paper, verdict, ours, missing)


def _ef_rows(study: Study) -> list[tuple[str, Row | None, float]]:
    return [
        ("EF + Top10%, warmup", study.topk(0.1, feedback="ef", warmup=True), 0.1),
        ("EF21 + Top5%", study.topk(0.05, feedback="ef21"), 0.05),
        ("EF21 + Top10%", study.topk(0.1, feedback="ef21"), 0.1),
        ("EF21 + Top10%, warmup", study.topk(0.1, feedback="ef21", warmup=True), 0.1),
    ]


def ef_restores_uncompressed_inference(study: Study) -> Finding:
    """Table 3: with EF / EF21 the model works about as well with compression off as on."""
    title, table = "Error feedback makes uncompressed inference work", "Table 3"
    paper = (
        "|on - off| of EF / EF21 rows 0.08-1.17 points, against 15.98 for plain Top10% (EFmixed is the exception: 29.6)"
    )
    rows = _ef_rows(study)
    missing = _missing([(label, r) for label, r, _ in rows])
    done = [(label, r, k) for label, r, k in rows if r and r.finished]
    if not done:
        return _pending(title, table, paper, missing)
    support = contradict = 0
    parts = []
    for label, r, k in done:
        gap = r.acc_on - r.acc_off
        plain = study.topk(k)
        plain_gap = plain.acc_on - plain.acc_off if plain and plain.finished else None
        small = abs(gap) <= MARGIN and (plain_gap is None or abs(gap) < abs(plain_gap))
        support += small
        contradict += not small
        parts.append(
            f"{label} {_signed(gap)}" + (f" (plain {_pct(k)} {_signed(plain_gap)})" if plain_gap is not None else "")
        )
    mixed = study.topk(0.1, feedback="efmixed", warmup=True)
    ours = "on minus off: " + "; ".join(parts)
    if mixed and mixed.finished:
        ours += f"; EFmixed + Top10%, warmup {_signed(mixed.acc_on - mixed.acc_off)}"
    return _found(title, table, paper, _combine(support, contradict, len(done)), ours, missing)


def ef_does_not_beat_topk(study: Study) -> Finding:
    """Table 3 vs 2: EF / EF21 do not raise compressed-inference accuracy over plain TopK."""
    title, table = "Error feedback does not improve on plain TopK", "Table 3"
    paper = (
        "EF21 + Top10% 91.19 and EF + Top10% (warmup) 89.85 vs plain Top10% 91.87; EF21 + Top5% 89.29 vs Top5% 90.01"
    )
    rows = _ef_rows(study)
    needed = [(label, r) for label, r, _ in rows] + [("Top10%", study.topk(0.1)), ("Top5%", study.topk(0.05))]
    missing = _missing(needed)
    done = [
        (label, r, study.topk(k))
        for label, r, k in rows
        if r and r.finished and study.topk(k) and study.topk(k).finished
    ]
    if not done:
        return _pending(title, table, paper, missing)
    parts, better = [], 0
    for label, r, plain in done:
        diff = r.acc_on - plain.acc_on
        better += diff > MARGIN
        parts.append(f"{label} {r.acc_on:.2f} vs plain {plain.acc_on:.2f} ({_signed(diff)})")
    verdict = "holds" if better == 0 else ("does not hold" if better == len(done) else "mixed")
    return _found(title, table, paper, verdict, "; ".join(parts), missing)


def aqsgd_degrades_beyond_30(study: Study) -> Finding:
    """Table 4: AQ-SGD + TopK stays near the baseline at Top50/30% and falls behind at Top20/10%."""
    title, table = "AQ-SGD with TopK degrades beyond Top30%", "Table 4"
    paper = "compressed inference vs baseline 93.00: Top50% 92.54, Top30% 91.61, then Top20% 87.80 and Top10% 84.16 (plain TopK at 20/10%: 92.73 / 91.87)"
    base = study.baseline("resnet18")
    levels = (0.5, 0.3, 0.2, 0.1)
    rows = [(f"AQ-SGD + {_pct(k)}", study.topk(k, feedback="aqsgd", warmup=True)) for k in levels]
    missing = _missing([("baseline", base), *rows])
    if base is None or not base.finished or all(r is None or not r.finished for _, r in rows):
        return _pending(title, table, paper, missing)
    support = contradict = 0
    parts = []
    for k, (label, r) in zip(levels, rows, strict=True):
        if r is None or not r.finished:
            continue
        drop = r.acc_on - base.acc_on
        close = drop >= -MARGIN
        expected_close = k >= 0.3
        support += close == expected_close
        contradict += close != expected_close
        plain = study.topk(k)
        parts.append(
            f"{label} {_signed(drop)}"
            + (f" (plain {_pct(k)} {_signed(plain.acc_on - base.acc_on)})" if plain and plain.finished else "")
        )
    ours = (
        f"compressed inference vs the baseline ({base.acc_on:.2f}): "
        + "; ".join(parts)
        + f" (the check: within {MARGIN:g} points at Top50/30%, further below at Top20/10%)"
    )
    return _found(title, table, paper, _combine(support, contradict, support + contradict), ours, missing)


def independent_topk_diverges(study: Study) -> Finding:
    """Table 5: on GPT-2, TopK on gradients of their own (not the activations' indices) breaks training."""
    title, table = "Independent TopK on activations and gradients diverges on the transformer", "Table 5"
    paper = "Top10% separate: eval loss 8.00 (perplexity 2990) against 4.31 when gradients reuse the activations' indices and 3.05 uncompressed"
    reuse = study.topk(0.1, model="gpt2", backward="topk:reuse")
    separate = study.topk(0.1, model="gpt2")
    base = study.baseline("gpt2")
    missing = _missing([("Top10% (reused indices)", reuse), ("Top10% separate", separate)])
    if missing:
        return _pending(title, table, paper, missing)
    diff = separate.loss_on - reuse.loss_on
    ours = f"eval loss (compressed inference) Top10% separate {separate.loss_on:.3f} vs reused indices {reuse.loss_on:.3f} ({_signed(diff, ' nats')})"
    if base and base.finished:
        ours += f", uncompressed baseline {base.loss_on:.3f}"
    verdict = "holds" if diff > 1.0 else ("mixed" if diff > LOSS_MARGIN else "does not hold")
    ours += " (the check: separate ends more than 1 nat worse)"
    return Finding(title, table, paper, verdict, ours)


def gpt2_topk_ladder(study: Study) -> Finding:
    """Table 5: eval loss grows as K shrinks, clearly from Top20%."""
    title, table = "On the transformer, eval loss grows as TopK gets stronger", "Table 5"
    paper = "eval loss 3.05 uncompressed, Top50% 3.11, Top30% 3.27, Top20% 3.51, Top10% 4.31"
    base = study.baseline("gpt2")
    levels = (0.5, 0.3, 0.2, 0.1)
    rows = [(_pct(k), study.topk(k, model="gpt2", backward="topk:reuse")) for k in levels]
    missing = _missing([("baseline", base), *rows])
    if missing:
        return _pending(title, table, paper, missing)
    losses = [base.loss_on] + [r.loss_on for _, r in rows]
    ours = f"eval loss uncompressed {base.loss_on:.3f}, " + ", ".join(f"{label} {r.loss_on:.3f}" for label, r in rows)
    rising = all(b >= a - LOSS_MARGIN for a, b in zip(losses, losses[1:], strict=False))
    clear = rows[-1][1].loss_on > base.loss_on + 2 * LOSS_MARGIN
    verdict = "holds" if rising and clear else ("mixed" if clear or rising else "does not hold")
    return Finding(title, table, paper, verdict, ours)


CHECKS = (
    gradients_more_sensitive,
    strongest_safe_topk,
    topk_needs_compressed_inference,
    ef_restores_uncompressed_inference,
    ef_does_not_beat_topk,
    aqsgd_degrades_beyond_30,
    independent_topk_diverges,
    gpt2_topk_ladder,
)


def check_all(rows: list[Row]) -> list[Finding]:
    study = Study(rows)
    return [check(study) for check in CHECKS]


def format_findings(findings: list[Finding]) -> list[str]:
    """Markdown: one bullet per finding with the paper's numbers and ours."""
    lines = []
    for f in findings:
        lines.append(f"- **{f.title}** ({f.table}): **{f.verdict}**.")
        lines.append(f"  - Paper: {f.paper}.")
        lines.append(f"  - Here: {f.ours}.")
    return lines

"""The paper's findings, checked against a study's measured rows.

Each check names the claim, what the paper measured, and what we measured, and gives a verdict
from our numbers only, every comparison judged against the spread over seeds (swarm.study.noise):
`holds` (every comparison agrees with the paper beyond the noise), `does not hold` (every one
contradicts it beyond the noise), `mixed` (some agree and some contradict, beyond the noise),
`within noise` (otherwise), `not judged: single seed (...)` (a row it compares has one seed, so
there is no spread; the lean with the fixed guess in brackets) or `pending` (the rows it needs have
not finished). Each finding's text gives the comparisons that decided it, with their noise.

Accuracies are percentages. Some claims carry a tolerance of their own: "close to the baseline"
means within `MARGIN` points (the paper's reading of its Tables 2 and 4), "diverges" on the
transformer means more than 1 nat worse, and the loss ladder allows `LOSS_MARGIN` nats per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.study.noise import Diff, combine, judged, paired, unpaired
from swarm.study.rows import Row, Study

MARGIN = 2.0  # accuracy points: the tolerance of "close to the baseline"
LOSS_MARGIN = 0.1  # nats, for the language model


@dataclass
class Finding:
    title: str
    table: str
    paper: str  # what the paper measured
    verdict: str  # holds | does not hold | mixed | pending
    ours: str  # what we measured (or what is missing)


def _pct(ratio: float) -> str:
    return f"Top{100 * ratio:g}%"


def between(a: Row, key_a: str, b: Row, key_b: str) -> Diff:
    """a.key_a - b.key_b over seeds: paired within one row, unpaired across rows."""
    kind = "loss" if key_a.startswith("loss") else "acc"
    if a is b:
        return paired(a.values(key_a), a.values(key_b), kind)
    return unpaired(a.values(key_a), b.values(key_b), kind)


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
    diffs, parts = [], []
    for fw_heavy, bw_heavy, (a, b), (c, d) in done:
        diff = between(bw_heavy, "acc_on", fw_heavy, "acc_on")
        diffs.append(diff)
        parts.append(f"fw{c}-bw{d} {bw_heavy.acc_on:.2f} vs fw{a}-bw{b} {fw_heavy.acc_on:.2f}: {diff.text()}")
    signs = [d.sign() for d in diffs]
    # holds: the gradient-heavy split is better beyond the noise at least once and never worse beyond it
    if 1 in signs:
        verdict = "mixed" if -1 in signs else "holds"
    else:
        verdict = "does not hold" if -1 in signs else "within noise"
    ours = "; ".join(parts) + " (the check: better beyond the noise at least once, never worse beyond it)"
    return _found(title, table, paper, judged(verdict, diffs), ours, missing)


TOPK_LEVELS = (0.5, 0.3, 0.2, 0.1, 0.05, 0.02)


def _close(diff: Diff) -> int:
    """+1: within MARGIN of the reference beyond the noise; -1: further below beyond it; 0: within noise."""
    return diff.sign(-MARGIN)


def strongest_safe_topk(study: Study) -> Finding:
    """Table 2: Top10% is the smallest K whose compressed-inference accuracy stays within MARGIN of the baseline."""
    title, table = "Top10% is the strongest TopK that stays close to the baseline", "Table 2"
    paper = "compressed-inference accuracy within 2 points of the baseline (93.00) down to Top10% (91.87); Top5% 90.01, Top2% 85.52"
    base = study.baseline("resnet18")
    rows = [(_pct(k), study.topk(k)) for k in TOPK_LEVELS]
    missing = _missing([("baseline", base), *rows])
    if base is None or not base.finished or missing:
        return _pending(title, table, paper, missing)
    diffs = [between(r, "acc_on", base, "acc_on") for _, r in rows]
    close = [_close(d) for d in diffs]
    # agrees: every level down to Top10% clearly close, Top5% clearly not (Top2% follows from the paper's trend)
    signs = [c for k, c in zip(TOPK_LEVELS, close, strict=True) if k >= 0.1] + [-close[TOPK_LEVELS.index(0.05)]]
    verdict = combine(signs) if -1 not in signs else "does not hold"
    drops = "; ".join(f"{label} {d.text()}" for (label, _), d in zip(rows, diffs, strict=True))
    ours = f"vs the baseline ({base.acc_on:.2f}): {drops} (the check: within {MARGIN:g} points beyond the noise down to Top10%, not at Top5%)"
    return Finding(title, table, paper, judged(verdict, diffs), ours)


def topk_needs_compressed_inference(study: Study) -> Finding:
    """Table 2: a model trained with TopK is better evaluated with TopK on (gap grows as K shrinks)."""
    title, table = "A model trained with TopK needs compressed inference", "Table 2"
    paper = "accuracy on minus off: Top50% +0.22, Top30% +1.80, Top20% +5.99, Top10% +15.98, Top5% +34.92, Top2% +35.57"
    rows = [(_pct(k), study.topk(k)) for k in TOPK_LEVELS]
    missing = _missing(rows)
    done = [(label, r, k) for (label, r), k in zip(rows, TOPK_LEVELS, strict=True) if r and r.finished]
    strong = [(label, r) for label, r, k in done if k <= 0.2]
    if not strong:
        return _pending(title, table, paper, missing or ["Top20% and below"])
    gaps = {label: between(r, "acc_on", r, "acc_off") for label, r, _ in done}
    decisive = [gaps[label] for label, _ in strong]
    ours = "accuracy on minus off: " + "; ".join(f"{label} {d.text()}" for label, d in gaps.items())
    ours += " (the check: every level at or below Top20% gains beyond the noise)"
    return _found(title, table, paper, judged(combine([d.sign() for d in decisive]), decisive), ours, missing)


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
    diffs, signs, parts = [], [], []
    for label, r, k in done:
        gap = between(r, "acc_on", r, "acc_off")
        plain = study.topk(k)
        plain_gap = between(plain, "acc_on", plain, "acc_off") if plain and plain.finished else None
        # small: |on - off| within MARGIN beyond the noise (and smaller than plain TopK's gap)
        small = min(gap.sign(-MARGIN), -gap.sign(MARGIN))
        if small == 1 and plain_gap is not None and abs(gap.value) >= abs(plain_gap.value):
            small = 0
        diffs.append(gap)
        signs.append(small)
        parts.append(f"{label} {gap.text()}" + (f" (plain {_pct(k)} {plain_gap.value:+.2f})" if plain_gap else ""))
    mixed = study.topk(0.1, feedback="efmixed", warmup=True)
    ours = "on minus off: " + "; ".join(parts)
    if mixed and mixed.finished:
        ours += f"; EFmixed + Top10%, warmup {between(mixed, 'acc_on', mixed, 'acc_off').text()}"
    ours += f" (the check: |on - off| within {MARGIN:g} points beyond the noise)"
    return _found(title, table, paper, judged(combine(signs), diffs), ours, missing)


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
    diffs = [between(r, "acc_on", plain, "acc_on") for _, r, plain in done]
    parts = [
        f"{label} {r.acc_on:.2f} vs plain {plain.acc_on:.2f}: {d.text()}"
        for (label, r, plain), d in zip(done, diffs, strict=True)
    ]
    # agrees: error feedback below plain TopK beyond the noise; contradicts: above it beyond the noise
    verdict = combine([-d.sign() for d in diffs])
    return _found(title, table, paper, judged(verdict, diffs), "; ".join(parts), missing)


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
    diffs, signs, parts = [], [], []
    for k, (label, r) in zip(levels, rows, strict=True):
        if r is None or not r.finished:
            continue
        drop = between(r, "acc_on", base, "acc_on")
        diffs.append(drop)
        signs.append(_close(drop) if k >= 0.3 else -_close(drop))
        plain = study.topk(k)
        parts.append(
            f"{label} {drop.text()}"
            + (f" (plain {_pct(k)} {plain.acc_on - base.acc_on:+.2f})" if plain and plain.finished else "")
        )
    ours = (
        f"compressed inference vs the baseline ({base.acc_on:.2f}): "
        + "; ".join(parts)
        + f" (the check: within {MARGIN:g} points at Top50/30%, further below at Top20/10%, beyond the noise)"
    )
    return _found(title, table, paper, judged(combine(signs), diffs), ours, missing)


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
    diff = between(separate, "loss_on", reuse, "loss_on")
    ours = f"eval loss (compressed inference) Top10% separate {separate.loss_on:.3f} vs reused indices {reuse.loss_on:.3f}: {diff.text(' nats')}"
    if base and base.finished:
        ours += f", uncompressed baseline {base.loss_on:.3f}"
    ours += " (the check: separate ends more than 1 nat worse, beyond the noise)"
    return Finding(title, table, paper, judged(combine([diff.sign(1.0)]), [diff]), ours)


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
    ladder = [base] + [r for _, r in rows]
    # each level no more than LOSS_MARGIN below the one before, and Top10% clearly above the baseline
    steps = [between(b, "loss_on", a, "loss_on") for a, b in zip(ladder, ladder[1:], strict=False)]
    clear = between(rows[-1][1], "loss_on", base, "loss_on")
    signs = [d.sign(-LOSS_MARGIN) for d in steps] + [clear.sign(2 * LOSS_MARGIN)]
    ours = f"eval loss uncompressed {base.loss_on:.3f}, " + ", ".join(f"{label} {r.loss_on:.3f}" for label, r in rows)
    ours += "; each step up " + ", ".join(d.text() for d in steps) + f"; Top10% vs uncompressed {clear.text(' nats')}"
    ours += f" (the check: no step down by more than {LOSS_MARGIN:g}, Top10% more than {2 * LOSS_MARGIN:g} above, beyond the noise)"
    return Finding(title, table, paper, judged(combine(signs), [*steps, clear]), ours)


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

"""The scale benchmark's lab rows (swarm.bench.scale_lab_figures) as a markdown table, the scaling
per added replica, and a plot: measured and modelled samples/s against replicas and stages."""

from __future__ import annotations


def table(rows: list[dict]) -> str:
    lines = [
        "| stages | replicas | stage peers | samples/s | model | model off by | micro-batches per replica | links busy | payload Mbit/s sending | all-reduce s, lab / model (group) | peak RSS MiB per stage peer (private; p2pd RSS) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        routed = "; ".join("/".join(map(str, c)) for c in r["micro_batches_per_replica"].values())
        averaging = (
            f"{r['allreduce_s']:.2f} / {r['model_allreduce_s']:.2f} ({r['allreduce_group']})"
            if r["allreduce_s"] is not None
            else "-"
        )
        busy, sending = r.get("link_busy"), r.get("sending_mbit")
        load = "-" if not r.get("load") else f"{r['load'][0]:.1f}-{r['load'][1]:.1f}"
        memory = (
            "-"
            if r["rss_mib_per_peer"] is None
            else f"{r['rss_mib_per_peer']:.0f} ({r['private_mib_per_peer']:.0f}; {r['p2pd_rss_mib_per_peer']:.0f})"
        )
        lines.append(
            f"| {r['stages']} | {r['replicas']} | {r['peers']} | {r['samples_per_s']:.2f} | "
            f"{r['model_samples_per_s']:.2f} | {100 * r['model_error']:+.0f}% | {routed} | "
            f"{f'{busy[0]:.2f}-{busy[1]:.2f}' if busy else '-'} | {f'{sending[0]:.1f}-{sending[1]:.1f}' if sending else '-'} | "
            f"{averaging} | {memory} | {load} |"
        )
    return "\n".join(lines)


def scaling(rows: list[dict]) -> list[str]:
    """Per stage count with a one-replica row: what each added replica (every stage's) brought, as a
    fraction of one replica's samples/s, measured and modelled."""
    lines = []
    for stages in sorted({r["stages"] for r in rows}):
        mine = sorted(
            (r for r in rows if r["stages"] == stages and isinstance(r["replicas"], int)), key=lambda r: r["replicas"]
        )
        if len(mine) < 2 or mine[0]["replicas"] != 1:
            continue
        one, model_one = mine[0]["samples_per_s"], mine[0]["model_samples_per_s"]
        steps = []
        for before, after in zip(mine, mine[1:], strict=False):
            added = after["replicas"] - before["replicas"]
            measured = (after["samples_per_s"] - before["samples_per_s"]) / added / one
            modelled = (after["model_samples_per_s"] - before["model_samples_per_s"]) / added / model_one
            steps.append(f"{before['replicas']}->{after['replicas']}: {measured:.2f} (model {modelled:.2f})")
        last = mine[-1]
        lines.append(
            f"{stages} stages, each replica added brings (of one replica's samples/s): {'; '.join(steps)}; "
            f"{last['replicas']} replicas reach {last['samples_per_s'] / (last['replicas'] * one):.2f} of {last['replicas']}x one"
        )
    return lines


def plot(rows: list[dict], path: str, title: str) -> None:
    """samples/s measured (points) and modelled (lines) against replicas per stage, and against stages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    uniform = [r for r in rows if isinstance(r["replicas"], int)]
    for i, stages in enumerate(sorted({r["stages"] for r in uniform})):
        mine = sorted((r for r in uniform if r["stages"] == stages), key=lambda r: r["replicas"])
        if len(mine) > 1:
            xs = [r["replicas"] for r in mine]
            left.plot(xs, [r["samples_per_s"] for r in mine], "o", color=f"C{i}", label=f"{stages} stages, lab")
            left.plot(xs, [r["model_samples_per_s"] for r in mine], "-", color=f"C{i}", label=f"{stages} stages, model")
            one = mine[0]["samples_per_s"] if mine[0]["replicas"] == 1 else None
            if one:
                left.plot(xs, [one * x for x in xs], ":", color="grey", label="replicas x one replica")
    single = sorted((r for r in uniform if r["replicas"] == 1), key=lambda r: r["stages"])
    if single:
        xs = [r["stages"] for r in single]
        right.plot(xs, [r["samples_per_s"] for r in single], "o", color="C3", label="lab")
        right.plot(xs, [r["model_samples_per_s"] for r in single], "-", color="C3", label="model")
    left.set_xlabel("replicas of every stage")
    right.set_xlabel("stages (one replica)")
    for ax in (left, right):
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Pictures of benchmark runs (matplotlib, the optional `plot` extra): latency percentiles against the arrival
rate, and images/s against the arrival rate, one line per batching mode.

`plot_runs(runs, path)` takes the runs of `bench throughput` (rate, mode, p50_ms, p90_ms, p99_ms, images_per_s) or
of `bench serve` (rate, latency_s: {p50, p90, p99}, images_per_s; mode "serve"), writes a PNG and returns the
plotted series, {mode: {"rate": [...], "p50": [...], "p90": [...], "p99": [...], "images_per_s": [...]}} (s).
"""

from __future__ import annotations

from typing import Any

PERCENTILES = ("p50", "p90", "p99")


def series(runs: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for r in sorted(runs, key=lambda r: r["rate"]):
        s = out.setdefault(r.get("mode", "serve"), {"rate": [], **{p: [] for p in PERCENTILES}, "images_per_s": []})
        s["rate"].append(float(r["rate"]))
        for p in PERCENTILES:
            s[p].append(r[f"{p}_ms"] / 1e3 if f"{p}_ms" in r else r["latency_s"][p])
        s["images_per_s"].append(float(r["images_per_s"]))
    return out


def plot_runs(runs: list[dict[str, Any]], path: str, title: str = "") -> dict[str, dict[str, list[float]]]:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install 'diffgraph[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    data = series(runs)
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"p50": ":", "p90": "--", "p99": "-"}
    for i, (mode, s) in enumerate(data.items()):
        color = f"C{i}"
        for p in PERCENTILES:
            lat.plot(s["rate"], s[p], styles[p], marker="o", color=color, label=f"{mode} {p}")
        thr.plot(s["rate"], s["images_per_s"], "-", marker="o", color=color, label=mode)
    lat.set(xlabel="arrival rate (requests/s)", ylabel="latency (s)", title="latency percentiles vs load")
    lat.set_yscale("log")
    thr.set(xlabel="arrival rate (requests/s)", ylabel="images/s", title="throughput vs load")
    for ax in (lat, thr):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return data

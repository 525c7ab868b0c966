"""The sweep figure (as DistServe draws it): per-GPU goodput, SLO attainment, TTFT and TPOT
against the per-GPU request rate, one line per layout, the SLOs as dashed lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.outputs import pyplot


def plot_sweeps(path: Path, sweeps: list[dict[str, Any]]) -> bool:
    """Write the figure; False (nothing written) when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    config = sweeps[0]["config"]
    slo = {item.split(":")[0]: float(item.split(":")[1]) for item in config["slo"]}
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    (ax_good, ax_att), (ax_ttft, ax_tpot) = axes
    for sweep in sweeps:
        for layout in sweep["layouts"]:
            points = sorted(layout["points"], key=lambda p: p["rate_per_gpu"])
            if not points:
                continue
            x = [p["rate_per_gpu"] for p in points]
            label = f"{layout['layout']} ({layout['gpus']} GPUs)"
            ax_good.plot(x, [p["goodput_per_gpu"] for p in points], "o-", label=label)
            ax_att.plot(x, [100 * p["attainment"] for p in points], "o-", label=label)
            for ax, key in ((ax_ttft, "ttft_ms"), (ax_tpot, "tpot_ms")):
                line = ax.plot(x, [p["summary"][key]["p99"] for p in points], "o-", label=label)
                ax.plot(
                    x, [p["summary"][key]["p90"] for p in points], ":",
                    color=line[0].get_color(),
                )  # fmt: skip
    ax_good.set_ylabel("goodput per GPU (req/s meeting every SLO)")
    ax_att.axhline(100 * config["attainment"], ls="--", color="gray")
    ax_att.set_ylabel("SLO attainment (%)")
    for ax, key, name in ((ax_ttft, "ttft", "TTFT"), (ax_tpot, "tpot", "TPOT")):
        if key in slo:
            ax.axhline(slo[key], ls="--", color="gray", label=f"SLO {slo[key]:g} ms")
        ax.set_ylabel(f"{name} p99 (solid) and p90 (dotted), ms")
        ax.set_yscale("log")
    for ax in (ax_good, ax_att, ax_ttft, ax_tpot):
        ax.set_xlabel("request rate per GPU (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    model = Path(config.get("model") or "embedded").name
    fig.suptitle(f"{config['dataset']}, {model}, SLO {' '.join(config['slo'])} ms")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

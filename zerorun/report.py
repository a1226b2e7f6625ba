"""Pictures of a run or a sweep: ``zerorun-report RUN_DIR|SWEEP_DIR`` (also written at the end of every run).

A run: ``training.png`` (loss and the validation metric, tokens/s, LR against step), ``memory.png`` (the
gate's estimate as a stacked bar per phase, the measured peak of each rank drawn across it) and
``report.md``. A sweep: ``sweep.png`` (tokens/s and peak memory per point). matplotlib, headless (Agg).
``*_data`` functions return exactly what is drawn, so tests check the numbers behind the pictures.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .hardware import GIB
from .rundir import RunDir
from .sweep import measured_peaks

CATEGORIES = (  # stack order, bottom first, and the words that put an entry in each (see MATCH_ORDER)
    ("parameters", ("parameter", "model as built", "whole model")),
    ("gradients", ("grad",)),
    ("optimizer states", ("optimizer states", "master")),
    ("activations", ("activation",)),
    ("logits + loss", ("logits",)),
    ("buffers + transients", ("buffer", "bucket", "transient", "staging", "prefetch", "in flight", "flatten")),
)
RUNTIME = "runtime (process, heap, context, NCCL, margin)"
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868", "activations": "#c44e52",
          "logits + loss": "#8172b3", "buffers + transients": "#937860", "other": "#da8bc3", RUNTIME: "#8c8c8c"}

MATCH_ORDER = ("parameters", "activations", "optimizer states", "logits + loss", "buffers + transients", "gradients")
"""Which category claims a name first ("activation-grad working set" is activations, "embedding grad transient"
a transient, "tied-embedding grad (pending)" a gradient)."""


def category(name: str) -> str:
    low, words = name.lower(), dict(CATEGORIES)
    return next((cat for cat in MATCH_ORDER if any(w in low for w in words[cat])), "other")


def memory_data(estimate: Dict[str, Any], summary: Dict[str, Any]) -> Dict[str, Any]:
    """Per phase: bytes by category (the allocator's phases plus the runtime terms the peak adds), and each
    rank's measured peak (resident set on CPU ranks, device peak on GPUs)."""
    phases = estimate.get("phases") or {}
    peak_phase = estimate.get("peak_phase")
    runtime = int(estimate.get("per_rank_peak_bytes", 0)) - sum((phases.get(peak_phase) or {}).values())
    bars: Dict[str, Dict[str, int]] = {}
    for name, entries in phases.items():
        stack: Dict[str, int] = {}
        for k, v in entries.items():
            stack[category(k)] = stack.get(category(k), 0) + int(v)
        stack[RUNTIME] = max(0, runtime)
        bars[name] = stack
    measured = measured_peaks(summary)
    return {"bars": bars, "measured": measured, "capacity": estimate.get("device_capacity_bytes"),
            "estimate": estimate.get("per_rank_peak_bytes"), "peak_phase": peak_phase, "device": estimate.get("device")}


def training_data(metrics: List[Dict[str, Any]]) -> Dict[str, List]:
    val = next((k for k in ("val_accuracy", "val_loss") if any(k in m for m in metrics)), None)
    return {"step": [m["step"] for m in metrics], "loss": [m["loss"] for m in metrics],
            "tokens_per_s": [m["tokens_per_s"] for m in metrics], "lr": [m["lr"] for m in metrics],
            "val_metric": val, "val_step": [m["step"] for m in metrics if val in m] if val else [],
            "val": [m[val] for m in metrics if val in m] if val else []}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_memory(data: Dict[str, Any], out: Path, title: str) -> Path:
    plt = _plt()
    names = list(data["bars"])
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(names) + 2), 4.5))
    bottom = [0.0] * len(names)
    cats = [c for c, _ in CATEGORIES] + ["other", RUNTIME]
    for cat in cats:
        vals = [data["bars"][n].get(cat, 0) / GIB for n in names]
        if any(vals):
            ax.bar(names, vals, bottom=bottom, label=cat, color=COLORS[cat])
            bottom = [b + v for b, v in zip(bottom, vals)]
    for r, m in enumerate(data["measured"]):
        ax.axhline(m / GIB, color="black", linestyle="--", linewidth=1,
                   label="measured peak per rank" if r == 0 else None)
    if data.get("capacity"):
        ax.axhline(data["capacity"] / GIB, color="red", linewidth=1.5, label="capacity")
    ax.set_ylabel("GiB per rank")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def draw_training(data: Dict[str, List], out: Path, title: str) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    axes[0].plot(data["step"], data["loss"], label="train loss")
    if data["val_metric"]:
        twin = axes[0].twinx() if data["val_metric"] == "val_accuracy" else axes[0]
        twin.plot(data["val_step"], data["val"], "o-", color="C1", label=data["val_metric"])
        twin.legend(fontsize=7, loc="upper right")
    axes[0].legend(fontsize=7, loc="upper left")
    axes[0].set_title(title, fontsize=9)
    axes[1].plot(data["step"], data["tokens_per_s"], color="C2")
    axes[1].set_ylabel("tokens/s")
    axes[2].plot(data["step"], data["lr"], color="C3")
    axes[2].set_ylabel("learning rate")
    axes[2].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run_report(run_dir: Path) -> List[Path]:
    """training.png, memory.png and report.md in the run dir."""
    rd = RunDir(run_dir)
    metrics, summary, estimate = rd.read_metrics(), rd.read_summary() or {}, rd.read_estimate() or {}
    out: List[Path] = []
    name = run_dir.name
    if metrics:
        out.append(draw_training(training_data(metrics), run_dir / "training.png", f"{name}: training"))
    if estimate.get("phases"):
        mem = memory_data(estimate, summary)
        out.append(draw_memory(mem, run_dir / "memory.png",
                               f"{name}: the gate's estimate per phase ({mem['device']}), measured peaks dashed"))
    lines = [f"# {name}", ""]
    if summary:
        lines += [f"- final loss {summary.get('final_loss')}, {summary.get('tokens_per_s') or 0:,.0f} tokens/s, "
                  f"world size {summary.get('world_size')}, status {summary.get('status')}"]
    if estimate:
        lines += [f"- gate estimate {estimate.get('per_rank_peak_bytes', 0) / GIB:.2f} GiB per rank (peak in "
                  f"{estimate.get('peak_phase')}), measured "
                  + ", ".join(f"{m / GIB:.2f}" for m in measured_peaks(summary)) + " GiB"]
    lines += ["", *[f"![{p.stem}]({p.name})" for p in out]]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    return out + [run_dir / "report.md"]


def sweep_data(sweep_dir: Path) -> List[Dict[str, Any]]:
    import csv

    rows = list(csv.DictReader((sweep_dir / "sweep_summary.csv").open()))
    num = lambda v: float(v) if v not in ("", None) else 0.0  # noqa: E731
    return [{"point": int(r["point"]), "label": f"#{r['point']}", "status": r["status"],
             "tokens_per_s": num(r["tokens_per_s"]), "measured_peak_gib": num(r["measured_peak_gib"]),
             "estimated_peak_gib": num(r["estimated_peak_gib"])} for r in sorted(rows, key=lambda r: int(r["point"]))]


def sweep_report(sweep_dir: Path) -> List[Path]:
    data = sweep_data(sweep_dir)
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [d["label"] + ("" if d["status"] == "completed" else f"\n({d['status']})") for d in data]
    a.bar(labels, [d["tokens_per_s"] for d in data], color="C2")
    a.set_title("tokens/s (finished points)", fontsize=9)
    x = range(len(data))
    b.bar([i - 0.2 for i in x], [d["estimated_peak_gib"] for d in data], width=0.4, label="estimated")
    b.bar([i + 0.2 for i in x], [d["measured_peak_gib"] for d in data], width=0.4, label="measured")
    b.set_xticks(list(x), labels)
    b.set_title("peak memory per rank, GiB", fontsize=9)
    b.legend(fontsize=7)
    fig.tight_layout()
    out = sweep_dir / "sweep.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [out]


def estimate_table_data(rows: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """zerorun-estimate's rows (label, Estimate): each row's peak by category, and the device capacity."""
    bars = {}
    for label, e in rows:
        stack: Dict[str, int] = {}
        for k, v in e.components.items():
            cat = category(k) if category(k) != "other" else RUNTIME
            stack[cat] = stack.get(cat, 0) + int(v)
        bars[label.replace("  offload ", "\n")] = stack
    return {"bars": bars, "measured": [], "capacity": rows[0][1].device_capacity_bytes if rows else None}


def draw_estimate_table(rows: List[Tuple[str, Any]], out: Path, title: str) -> Path:
    return draw_memory(estimate_table_data(rows), out, title)


def report(path: Path) -> List[Path]:
    if (path / "sweep_summary.csv").is_file():
        return sweep_report(path)
    return run_report(path)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: zerorun-report RUN_DIR|SWEEP_DIR", file=sys.stderr)
        return 2
    for p in report(Path(args[0])):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The end of a sweep (``zerorun -m ...``): one table of every point, the fastest that finished named with its
exact command, written as ``sweep_summary.md`` and ``sweep_summary.csv`` in the sweep dir and printed.

``rows`` reads what each point left in its run dir (summary.json, estimate.json); ``render`` is pure.
"""
from __future__ import annotations

import csv
import io
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .hardware import GIB
from .rundir import RunDir

COLUMNS = ("point", "overrides", "status", "why", "estimated_peak_gib", "measured_peak_gib", "tokens_per_s",
           "final_loss", "val_metric", "val_value", "run_dir")


@dataclass
class Point:
    point: int
    overrides: List[str]
    status: str          # completed, memory (refused by the gate), bad-config, failed, ...
    why: str
    estimated_peak_gib: Optional[float]
    measured_peak_gib: Optional[float]
    tokens_per_s: Optional[float]
    final_loss: Optional[float]
    val_metric: str
    val_value: Optional[float]
    run_dir: str


def measured_peaks(summary: Dict[str, Any]) -> List[int]:
    """Each rank's measured peak from summary.json: its resident set on CPU ranks, its device peak on GPUs."""
    return [max(p.get("peak_rss_bytes", 0), (p.get("device_bytes") or {}).get("device_peak", 0))
            for p in summary.get("peak_memory", [])]


def point_of(num: int, overrides: Sequence[str], status: str, why: str, run_dir: str) -> Point:
    """One sweep point from its outcome and what its run dir holds."""
    rd = RunDir(Path(run_dir))
    summary, estimate = rd.read_summary() or {}, rd.read_estimate() or {}
    peaks = measured_peaks(summary)
    metric = next((k for k in ("val_accuracy", "val_perplexity", "val_loss") if summary.get(k) is not None), "")
    est = estimate.get("per_rank_peak_bytes")
    return Point(num, list(overrides), status, why, round(est / GIB, 3) if est else None,
                 round(max(peaks) / GIB, 3) if peaks else None, summary.get("tokens_per_s"),
                 summary.get("final_loss"), metric, summary.get(metric) if metric else None, run_dir)


def ranked(points: Sequence[Point]) -> List[Point]:
    """Completed points by throughput, fastest first; then the others in sweep order."""
    done = sorted((p for p in points if p.status == "completed" and p.tokens_per_s),
                  key=lambda p: -p.tokens_per_s)
    return done + [p for p in points if p not in done]


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"
    return str(v)


def render(points: Sequence[Point], base_args: Sequence[str] = ()) -> Tuple[str, str, Optional[Point]]:
    """(markdown, csv, the fastest completed point)."""
    rows = ranked(points)
    best = rows[0] if rows and rows[0].status == "completed" and rows[0].tokens_per_s else None
    md = ["| # | overrides | status | estimated peak GiB | measured peak GiB | tokens/s | final loss | validation |",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in rows:
        why = p.why[len(p.status) + 2:] if p.why.startswith(p.status + ": ") else p.why  # "memory: memory: ..."
        status = p.status + (f": {why}" if why else "")
        md.append(f"| {p.point} | `{' '.join(p.overrides) or 'defaults'}` | {status.replace('|', '/')} | "
                  f"{_fmt(p.estimated_peak_gib)} | {_fmt(p.measured_peak_gib)} | {_fmt(p.tokens_per_s)} | "
                  f"{_fmt(p.final_loss, 4)} | {(p.val_metric + ' ' + _fmt(p.val_value, 4)) if p.val_metric else '-'} |")
    if best:
        cmd = "zerorun " + " ".join(shlex.quote(a) for a in [*base_args, *best.overrides])
        md += ["", f"Fastest: point {best.point} ({_fmt(best.tokens_per_s)} tokens/s): `{cmd}`"]
    else:
        md += ["", "No point finished."]
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=COLUMNS)
    w.writeheader()
    for p in rows:
        w.writerow({**asdict(p), "overrides": " ".join(p.overrides)})
    return "\n".join(md) + "\n", out.getvalue(), best


def write(sweep_dir: Path, points: Sequence[Point], base_args: Sequence[str] = ()) -> Optional[Point]:
    md, table, best = render(points, base_args)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "sweep_summary.md").write_text(md)
    (sweep_dir / "sweep_summary.csv").write_text(table)
    print(md, flush=True)
    return best

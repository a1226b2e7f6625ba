"""Each rank's memory at the end of a run, and how it compares with the gate's estimate.

The comparison is on the figure that runs out: a CPU rank's peak resident set (what the OOM killer and a
cgroup limit judge), a GPU rank's device peak (reserved by PyTorch's allocator + what lives outside it).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

from ..hardware import GIB
from ..telemetry import accelerator_peak_bytes, device_figures, model_state_bytes, peak_rss_bytes

MILESTONES = ("ready", "built", "first step", "trained", "evaluated", "exported")
DEVICE_KEYS = ("allocated_peak", "reserved_peak", "outside_allocator", "device_peak")


def gather_memory(trainer, live: Optional[Dict[str, int]]) -> List[Dict[str, Any]]:
    """Every rank's memory figures, on every rank (one all-gather)."""
    import torch

    from .heap_limit import outside_heap_bytes, small_object_cache_bytes  # (heap_limit reads rank_figures)

    states = model_state_bytes(trainer.engine)
    stage = trainer.engine.stage_id if trainer.strategy.pipeline else -1
    marks = [trainer.rss.points.get(name, 0) for name in MILESTONES]
    device = device_figures()
    mine = torch.tensor([peak_rss_bytes(), accelerator_peak_bytes(), states["parameters"],
                         states["persistent parameters"], states["fp32 master copies"], states["optimizer states"],
                         (live or {}).get("init", 0), (live or {}).get("train", 0), stage,
                         trainer.heap_limit.get("limit_bytes", 0),
                         outside_heap_bytes() if trainer.heap_limit.get("limit_bytes") else 0,
                         small_object_cache_bytes(), *[device.get(k, 0) for k in DEVICE_KEYS], *marks],
                        dtype=torch.float64)
    mine = mine.to(trainer.device)  # NCCL gathers CUDA tensors only (a CPU one: "No backend type associated ...")
    gathered = [torch.zeros_like(mine) for _ in range(trainer.world)]
    trainer.dist.all_gather(gathered, mine)
    out = []
    n_dev = len(DEVICE_KEYS)
    for r, g in enumerate(gathered):
        g = [int(x) for x in g.tolist()]
        row: Dict[str, Any] = {"rank": r, "peak_rss_bytes": g[0], "accelerator_peak_allocated_bytes": g[1],
                               "model_state_bytes": {"parameters": g[2], "persistent_parameters": g[3],
                                                     "fp32_master": g[4], "optimizer_states": g[5]}}
        if any(g[12:12 + n_dev]):
            row["device_bytes"] = dict(zip(DEVICE_KEYS, g[12:12 + n_dev]))
        # The peak RSS so far as the rank passed each point: which part of the run set the peak.
        row["peak_rss_bytes_by_point"] = dict(zip(MILESTONES, g[12 + n_dev:]))
        if g[9]:  # the ceiling on its tcmalloc heap (launcher.heap_limit_mib; train/heap_limit.py)
            row["heap_limit_bytes"] = g[9]
            row["outside_heap_bytes"] = g[10]  # at the end: what the ceiling does not hold (heap_limit.py)
        if g[11]:  # tcmalloc ranks, at the end: what its small-object caches hold free (the heap-retention term)
            row["allocator_cache_bytes"] = g[11]
        if live is not None:
            row["live_tensor_peak_bytes"] = {"init": g[6], "train": g[7]}
        if trainer.strategy.pipeline:
            row["pipeline_stage"] = g[8]
        out.append(row)
    return out


def rank_figures(estimate: Mapping[str, Any], rank: int, stage: Optional[int] = None):
    """(point, bound) the gate gave one rank: its pipeline stage's figures for a pipeline; global rank 0 writes
    the export (and in a pipeline each stage's first replica sends its stage: ``exporting_rank``), the other ranks
    peak in training (other_ranks_*). Pure."""
    est = estimate
    if stage is not None and stage >= 0 and estimate.get("pipeline_stages"):
        est = estimate["pipeline_stages"][stage]
    point, bound = est.get("per_rank_peak_bytes"), est.get("per_rank_bound_bytes")
    if rank != est.get("exporting_rank", 0) and est.get("other_ranks_peak_bytes"):
        point, bound = est["other_ranks_peak_bytes"], est.get("other_ranks_bound_bytes", bound)
    return point, bound


def compare_with_estimate(estimate: Dict[str, Any], memory: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per rank: the gate's figure (its pipeline stage's, for a pipeline), the measured one, the error
    (estimate − measured) / measured, and which measurement it is. Pure."""
    out = []
    for row in memory:
        estimated, bound = rank_figures(estimate, row["rank"], row.get("pipeline_stage"))
        if "device_bytes" in row:
            measured, what = row["device_bytes"]["device_peak"], "device peak (allocator reserved + outside it)"
        else:
            measured, what = row["peak_rss_bytes"], "peak RSS"
        out.append({"rank": row["rank"], "measure": what, "estimated_bytes": estimated, "measured_bytes": measured,
                    "error": (estimated - measured) / measured if estimated and measured else None,
                    "bound_bytes": bound, "within_bound": measured <= bound if bound and measured else None,
                    "calibration": (estimate.get("calibration") or {}).get("source", "prior")})
    return out


def oom_lines(comparison: List[Dict[str, Any]]) -> List[str]:
    """The end-of-run line, and a warning per rank that used more than the gate's bound (its "at most" figure);
    above the estimate but within the bound is what the bound is for: said in the plain line, no warning."""
    rows = [c for c in comparison if c["error"] is not None]
    if not rows:
        return []
    worst = max(rows, key=lambda c: c["measured_bytes"])
    est = worst["estimated_bytes"]
    at_most = f", at most {worst['bound_bytes'] / GIB:.2f} GiB" if worst.get("bound_bytes") else ""
    within = ", within the bound" if worst.get("within_bound") and worst["measured_bytes"] > est else ""
    lines = [f"memory: {worst['measure']} {worst['measured_bytes'] / GIB:.2f} GiB (rank {worst['rank']}, the most), "
             f"gate estimated {est / GIB:.2f} GiB{at_most}: {100 * worst['error']:+.1f}%{within} "
             f"({worst['calibration']})."]
    for c in rows:
        if c.get("within_bound") is False:
            lines.append(f"warning: rank {c['rank']} used {c['measured_bytes'] / GIB:.2f} GiB, above the gate's bound "
                         f"of {c['bound_bytes'] / GIB:.2f} GiB: please report it (estimate.json and summary.json), and "
                         "leave headroom or calibrate on this machine (zerorun-calibrate with the same overrides).")
    return lines

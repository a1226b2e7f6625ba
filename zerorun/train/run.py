"""A rank's life: read the run dir, build, resume, train, export, report (summary.json), clean up."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..rundir import RunDir
from ..telemetry import TRACK_MEMORY_ENV, accelerator_peak_bytes, model_state_bytes, peak_rss_bytes
from .export import export
from .trainer import Trainer

MILESTONES = ("ready", "built", "first step", "trained", "evaluated", "exported")
MEASURES = ("accelerator_peak_allocated_bytes = torch.cuda.max_memory_allocated (0 on CPU); peak_rss_bytes = the "
            "rank process's peak resident set (getrusage: includes Python, torch and DeepSpeed themselves); "
            "model_state_bytes = the parameter, fp32-master and optimizer-state tensors DeepSpeed holds on the rank "
            "at the end")


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    args = [a for a in args if not a.startswith("--local_rank")]
    if len(args) != 1:
        print("usage: python -m zerorun.train RUN_DIR", file=sys.stderr)
        return 2
    run_dir = RunDir(Path(args[0]).resolve())
    t_start = time.time()
    # Opt-in live-tensor accounting (CPU ranks): every storage an op creates, from before the model is built,
    # so the init and training peaks compare with the estimate's allocator peak. It slows every op.
    tracker = None
    if os.environ.get(TRACK_MEMORY_ENV) == "1":
        from ..telemetry import live_bytes

        tracker = live_bytes()
        tracker.__enter__()
    trainer = Trainer(run_dir)
    trainer.build()
    live = {"init": tracker.peak if tracker else 0}
    if tracker:
        tracker.reset_peak()
    resume = run_dir.read_resume()
    if resume:
        trainer.resume(Path(resume["checkpoint_dir"]), resume["tag"])
    result = trainer.train()
    if tracker:
        live["train"] = tracker.peak
        tracker.__exit__(None, None, None)
    export_dir = export(trainer) if trainer.cfg.trainer.export else None
    trainer.rss.mark("exported")
    memory = gather_memory(trainer, live if tracker else None)
    if trainer.rank == 0:
        summary = build_summary(trainer, result, memory, export_dir, time.time() - t_start, tracked=bool(tracker))
        run_dir.write_summary(summary)
        print(f"zerorun: done. final loss {summary['final_loss']:.4f}, {summary['tokens_per_s']:.0f} tokens/s; "
              f"summary in {run_dir.file('summary.json')}", file=sys.stderr)
    trainer.dist.barrier()
    release_cpu_shm(trainer)
    return 0


def gather_memory(trainer: Trainer, live: Optional[Dict[str, int]]) -> List[Dict[str, Any]]:
    """Every rank's memory figures, on every rank (one all-gather)."""
    import torch

    states = model_state_bytes(trainer.engine)
    stage = trainer.engine.stage_id if trainer.strategy.pipeline else -1
    marks = [trainer.rss.points.get(name, 0) for name in MILESTONES]
    mine = torch.tensor([peak_rss_bytes(), accelerator_peak_bytes(), states["parameters"],
                         states["persistent parameters"], states["fp32 master copies"], states["optimizer states"],
                         (live or {}).get("init", 0), (live or {}).get("train", 0), stage, *marks],
                        dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(trainer.world)]
    trainer.dist.all_gather(gathered, mine)
    out = []
    for r, g in enumerate(gathered):
        g = [int(x) for x in g.tolist()]
        row: Dict[str, Any] = {"rank": r, "peak_rss_bytes": g[0], "accelerator_peak_allocated_bytes": g[1],
                               "model_state_bytes": {"parameters": g[2], "persistent_parameters": g[3],
                                                     "fp32_master": g[4], "optimizer_states": g[5]}}
        # The peak RSS so far as the rank passed each point: which part of the run set the peak.
        row["peak_rss_bytes_by_point"] = dict(zip(MILESTONES, g[9:]))
        if live is not None:
            row["live_tensor_peak_bytes"] = {"init": g[6], "train": g[7]}
        if trainer.strategy.pipeline:
            row["pipeline_stage"] = g[8]
        out.append(row)
    return out


def build_summary(trainer: Trainer, result: Dict[str, Any], memory: List[Dict[str, Any]], export_dir: Optional[str],
                  wall_time_s: float, tracked: bool) -> Dict[str, Any]:
    history = result["history"]
    speeds = [h["tokens_per_s"] for h in history[1:]] or [h["tokens_per_s"] for h in history]
    estimate = trainer.run_dir.read_estimate() or {}
    measures = MEASURES + ("; live_tensor_peak_bytes = peak bytes of live CPU tensor storages "
                           f"({TRACK_MEMORY_ENV}=1), in model build + deepspeed.initialize (init) and in the "
                           "training loop (train)" if tracked else "")
    return {
        "status": "completed",
        "steps": trainer.cfg.trainer.max_steps,
        "resumed_from_step": trainer.start_step,
        "final_loss": history[-1]["loss"] if history else None,
        "first_loss": history[0]["loss"] if history else None,
        "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
        "world_size": trainer.world,
        "accelerator": trainer.accel.device_name(),
        "peak_memory": memory,
        "peak_memory_measures": measures,
        "estimated_components": estimate.get("components"),
        "estimated_peak_bytes": estimate.get("per_rank_peak_bytes"),
        "checkpoint": result["checkpoint"],
        "export": export_dir,
        "wall_time_s": wall_time_s,
        **result["final_eval"],
    }


def release_cpu_shm(trainer: Trainer) -> None:
    """After the last collective, unlink this rank's DeepSpeed CPU all-reduce segment (see
    launcher.cpu_shm_name); the mapping stays valid for anyone still holding it."""
    if trainer.accel.device_name() != "cpu":
        return
    from ..launcher import release_cpu_shm as release

    release(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), trainer.rank)

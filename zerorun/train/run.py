"""A rank's life: read the run dir, build, resume, train, export, report (summary.json), clean up."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .. import faults
from ..allocators import running as running_allocator
from ..rundir import RunDir
from ..telemetry import TRACK_MEMORY_ENV
from .export import export
from .memory_report import compare_with_estimate, gather_memory, oom_lines
from .trainer import Trainer

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
    state: Dict[str, Any] = {}
    try:
        code = _run(run_dir, state)
    except BaseException as e:  # noqa: B036 (an OOM can surface as MemoryError)
        if isinstance(e, faults.DiskFull):
            _leave_disk_full(run_dir, state.get("trainer"), e)
        if not faults.is_oom(e):
            raise
        _leave_after_oom(run_dir, state.get("trainer"), e)
    _leave(run_dir, code)


def _leave(run_dir: RunDir, code: int) -> None:
    """Exit now that everything is written and the last barrier passed: the interpreter's teardown of torch,
    DeepSpeed and gloo takes ~1 s per rank and writes nothing, and the launcher polls once a second. Buffers that
    do hold something are flushed first (streams, logging, a W&B run)."""
    import logging

    if "wandb" in sys.modules and getattr(sys.modules["wandb"], "run", None) is not None:
        sys.modules["wandb"].finish()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == faults.EXIT_OK:
        faults.mark_clean_exit(run_dir.path)
    os._exit(code)


def _leave_disk_full(run_dir: RunDir, trainer: Optional[Trainer], error: "faults.DiskFull") -> None:
    """The disk filled during a save: record it with the newest complete checkpoint, remove the partial save
    (it only holds space), say it in one line and leave; the launcher stops with EXIT_DISK_FULL."""
    import shutil

    rank = trainer.rank if trainer else int(os.environ.get("RANK", 0))
    if not error.peer:
        for attempt in range(2):
            try:  # first, so a peer whose collective breaks when this rank leaves can tell why
                faults.record(run_dir.path, rank, "disk_full", step=error.step, path=error.path,
                              latest=error.latest, error=error.cause)
                break
            except OSError:  # the run dir is on the full disk too: the partial save holds what the record needs
                shutil.rmtree(error.partial, ignore_errors=True)
        print(f"zerorun: rank {rank}: {error}", file=sys.stderr, flush=True)
    shutil.rmtree(error.partial, ignore_errors=True)
    os._exit(faults.EXIT_DISK_FULL)


def _leave_after_oom(run_dir: RunDir, trainer: Optional[Trainer], error: BaseException) -> None:
    """Record what ran out and leave at once: no collective (the peers may be in one), no cleanup that
    allocates. The launcher relaunches with less memory per micro-batch (zerorun.supervise)."""
    from ..telemetry import device_figures, rss_status

    rank = trainer.rank if trainer else int(os.environ.get("RANK", 0))
    info: Dict[str, Any] = {"error": str(error).splitlines()[0][:500] if str(error) else type(error).__name__,
                            "rss": rss_status()}
    if trainer is not None:
        info.update(step=trainer.step, micro_batch_size=trainer.plan.micro_batch_size,
                    grad_accum_steps=trainer.plan.grad_accum_steps, device=device_figures())
        if trainer.heap_limit.get("limit_bytes"):  # live memory may have met the ceiling on the rank's heap
            info["heap_limit_bytes"] = trainer.heap_limit["limit_bytes"]
    try:
        faults.record(run_dir.path, rank, "oom", **info)
        print(f"zerorun: rank {rank} ran out of memory at step {info.get('step', 'setup')} "
              f"(micro-batch {info.get('micro_batch_size', '?')}): {info['error']}"
              + (f" (its tcmalloc heap is held under {info['heap_limit_bytes'] / 2**20:.0f} MiB by "
                 "launcher.heap_limit_mib; 0 lifts the ceiling)" if info.get("heap_limit_bytes") else ""),
              file=sys.stderr, flush=True)
    finally:
        os._exit(faults.EXIT_OOM)


def _run(run_dir: RunDir, state: Dict[str, Any]) -> int:
    t_start = time.time()
    # Opt-in live-tensor accounting (CPU ranks): every storage an op creates, from before the model is built,
    # so the init and training peaks compare with the estimate's allocator peak. It slows every op.
    tracker = None
    if os.environ.get(TRACK_MEMORY_ENV) == "1":
        from ..telemetry import live_bytes

        tracker = live_bytes()
        tracker.__enter__()
    trainer = state["trainer"] = Trainer(run_dir)
    trainer.build()
    live = {"init": tracker.peak if tracker else 0}
    if tracker:
        tracker.reset_peak()
    resume = run_dir.read_resume()
    if resume:
        trainer.resume(Path(resume["checkpoint_dir"]), resume["tag"])
    trainer.hold_heap()
    result = trainer.train()
    if result.get("preempted"):
        p = result["preempted"]
        faults.record(run_dir.path, trainer.rank, "preempted", **p)
        if trainer.rank == 0:
            print(f"zerorun: stopped at step {p['step']} ({p['signal']}); checkpoint {p['checkpoint']}",
                  file=sys.stderr, flush=True)
        trainer.dist.barrier()
        return faults.EXIT_PREEMPTED
    if tracker:
        live["train"] = tracker.peak
        tracker.__exit__(None, None, None)
    export_dir = export(trainer) if trainer.cfg.trainer.export else None
    trainer.rss.mark("exported")
    memory = gather_memory(trainer, live if tracker else None)
    if trainer.writes_run_dir:
        summary = build_summary(trainer, result, memory, export_dir if trainer.rank == 0 else None,
                                time.time() - t_start, tracked=bool(tracker))
        run_dir.write_summary(summary)
        print(f"zerorun: done. final loss {summary['final_loss']:.4f}, {summary['tokens_per_s']:.0f} tokens/s; "
              f"summary in {run_dir.file('summary.json')}", file=sys.stderr)
        for line in oom_lines(summary["memory_vs_estimate"]):
            print(f"zerorun: {line}", file=sys.stderr)
    trainer.dist.barrier()
    return 0


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
        # The fraction of the tokens in the trained batches that are not padding (LM blocks: 1.0); useful
        # tokens/s = tokens_per_s × this.
        "non_pad_fraction": result.get("non_pad_fraction"),
        "world_size": trainer.world,
        "accelerator": trainer.accel.device_name(),
        "allocator": running_allocator(),  # read from this rank's own mappings: what ran, whatever was asked
        "heap_limit": trainer.heap_limit,  # this rank's ceiling on its tcmalloc heap, and why (train/heap_limit.py)
        "peak_memory": memory,
        "peak_memory_measures": measures,
        "estimated_components": estimate.get("components"),
        "estimated_peak_bytes": estimate.get("per_rank_peak_bytes"),
        "memory_vs_estimate": compare_with_estimate(estimate, memory),
        "checkpoint": result["checkpoint"],
        "export": export_dir,  # global rank 0 exports (with a run dir per node: into node 0's)
        "written_by_rank": trainer.rank,
        "wall_time_s": wall_time_s,
        **result["final_eval"],
    }

"""What can stop a rank between steps: a stop request (preemption) that all ranks agree on, and the test
hooks that inject the faults zerorun recovers from (docs in zerorun/faults.py, README "When things go wrong").
"""
from __future__ import annotations

import os
import resource
import signal
from pathlib import Path
from typing import Callable, Optional, Tuple

from .. import faults

FAULT_KILL_ENV = "ZERORUN_FAULT_KILL"            # "RANK:STEP": SIGKILL that rank after that step
FAULT_OOM_ENV = "ZERORUN_FAULT_OOM"              # "RANK:STEP[:MIN_MICRO]": raise OutOfMemoryError before that step
FAULT_MEMLIMIT_ENV = "ZERORUN_FAULT_MEMLIMIT"    # "RANK:MIB": a real address-space limit once the model is built
FAULT_SAVE_KILL_ENV = "ZERORUN_FAULT_SAVE_KILL"  # "RANK:STEP:POINT": SIGKILL inside that step's save (checkpoint.py)
FAULT_SAVE_FILL_ENV = "ZERORUN_FAULT_SAVE_FILL"  # "RANK:STEP:KIB": fill that save's disk to KIB free first
FILLER = "disk-filler"
FAULT_SAVE_SNAPSHOT_ENV = "ZERORUN_FAULT_SAVE_SNAPSHOT"
""""STEP:DIR": at every point of that step's save, each rank copies the checkpoint dir to
DIR/rank{r}-point{p}/checkpoints: what a kill of that rank at that point would leave on disk (the other ranks
cannot pass the next barrier without it), so one run shows every kill point."""


def _spec(env: str) -> Optional[Tuple[int, ...]]:
    raw = os.environ.get(env, "")
    return tuple(int(x) for x in raw.split(":")) if raw else None


class StopFlag:
    """Set by SIGTERM/SIGUSR1/SIGUSR2 in this rank or by the launcher's stop file; ``agreed()`` is the
    same answer on every rank (one all-reduce of a flag per step), so all ranks save the same step."""

    def __init__(self, run_dir: Path, dist):
        self.run_dir, self.dist = run_dir, dist
        self.signal: Optional[str] = None
        for name in faults.STOP_SIGNALS:
            signal.signal(getattr(signal, name), self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.signal = signal.Signals(signum).name  # acted on at the next step boundary, never mid-collective

    def agreed(self, device, drawn, copies: int) -> Tuple[Optional[str], int]:
        """(why to stop or None, the step's data fingerprint): the same on every rank. The fingerprint is
        a hash summed over the sequence indices every data-parallel replica drew (``copies`` ranks per
        replica draw the same ones), so it is equal for the same global batch however it is split."""
        import torch

        local = self.signal is not None or faults.stop_requested(self.run_dir)
        mine = sum(int(i) * 2654435761 % 2**32 for idx in drawn for i in idx)
        both = torch.tensor([1.0 if local else 0.0, float(mine)], dtype=torch.float64, device=device)
        self.dist.all_reduce(both)
        fingerprint = int(both[1].item()) // max(1, copies)
        if both[0].item() <= 0:
            return None, fingerprint
        why = self.signal or ("stop requested by the launcher" if local else "a peer rank was signalled")
        return why, fingerprint


def kill_after(run_dir: Path, rank: int, step: int) -> None:
    """Once per run dir (a transient fault: a restart or resume of the run goes past it)."""
    spec = _spec(FAULT_KILL_ENV)
    done = Path(run_dir) / f".fault_kill_{rank}_{step}"
    if spec and spec == (rank, step) and not done.exists():
        done.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def inject_oom(rank: int, step: int, micro_batch: int) -> None:
    spec = _spec(FAULT_OOM_ENV)
    if spec and spec[:2] == (rank, step) and micro_batch >= (spec[2] if len(spec) > 2 else 1):
        import torch

        raise torch.OutOfMemoryError(f"injected by {FAULT_OOM_ENV} at micro-batch {micro_batch}")


def limit_memory(rank: int) -> None:
    """A real allocation failure for tests: cap this rank's address space at its current size + MIB, so
    the allocator's own error (not an injected one) ends a step that needs more."""
    spec = _spec(FAULT_MEMLIMIT_ENV)
    if not spec or spec[0] != rank:
        return
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + spec[1] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def save_hook(rank: int, step: int, root: Path) -> Optional[Callable[[int], None]]:
    """What a test does at each numbered point inside checkpoint.save of this step on this rank: SIGKILL the
    rank at one point (ZERORUN_FAULT_SAVE_KILL), snapshot the checkpoint dir (ZERORUN_FAULT_SAVE_SNAPSHOT), or
    fill the disk before the save so that it meets a real ENOSPC part-way (ZERORUN_FAULT_SAVE_FILL)."""
    kill, fill = _spec(FAULT_SAVE_KILL_ENV), _spec(FAULT_SAVE_FILL_ENV)
    kill_at = kill[2] if kill and kill[:2] == (rank, step) else None
    snap_step, _, snap_dir = os.environ.get(FAULT_SAVE_SNAPSHOT_ENV, "").partition(":")
    snapshot = snap_dir if snap_step == str(step) else None
    fill_to = fill[2] * 1024 if fill and fill[:2] == (rank, step) else None
    if kill_at is None and snapshot is None and fill_to is None:
        return None

    def at(point: int) -> None:
        if fill_to is not None and point == 0:
            import shutil

            with open(root / FILLER, "wb") as f:  # among the checkpoints: on their disk, never a tag
                os.posix_fallocate(f.fileno(), 0, max(0, shutil.disk_usage(root).free - fill_to))
        if snapshot:
            import shutil

            shutil.copytree(root, Path(snapshot) / f"rank{rank}-point{point}" / "checkpoints", dirs_exist_ok=True)
        if point == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return at

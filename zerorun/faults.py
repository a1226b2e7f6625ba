"""What ends a run early, as the ranks and the launcher agree on it: exit codes, the fault records a rank
leaves in the run dir, the stop request, and what counts as out of memory.

torchrun and the deepspeed CLI flatten a rank's exit code (any failure is 1), so a rank that knows why it
stops says so in a file, written atomically before it exits: ``faults/rank{r}.json``. The launcher reads
them after the ranks are gone (zerorun.supervise) and decides: recover, restart, or stop with a code that
tells a scheduler what happened.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .rundir import write_atomic

# Exit codes of `zerorun` (README "When things go wrong"); ranks use the same ones.
EXIT_OK = 0
EXIT_FAILED = 1          # a rank failed and restarts (trainer.max_restarts) did not help or were not allowed
EXIT_BAD_INPUT = 2       # config, data or the memory gate refused: nothing launched, nothing lost
EXIT_OOM = 3             # out of memory at runtime after trainer.oom_retries recoveries
EXIT_DISK_FULL = 74      # EX_IOERR: the disk filled while a checkpoint was written; the earlier one is intact
EXIT_PREEMPTED = 75      # EX_TEMPFAIL: stopped by a signal, a complete checkpoint saved; resume with trainer.resume=true

FAULTS_DIR = "faults"
STOP_FILE = "STOP"
"""The launcher asks the ranks to checkpoint and stop by creating this file in the run dir (it got SIGTERM);
ranks that get the signal themselves (Slurm signals every process of a step) set the same flag."""
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
"""SIGTERM: SageMaker spot, Kubernetes, scancel; SIGUSR1/2: Slurm ``--signal`` and submitit's default."""


def is_oom(exc: BaseException) -> bool:
    """An allocation failure: torch.OutOfMemoryError on a GPU; on CPU ranks MemoryError or the allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory", "not enough memory")."""
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "out of memory", "can't allocate memory", "not enough memory", "CUDA error: out of memory"))


class DiskFull(Exception):
    """No space left while saving step ``step`` under ``path``; ``latest`` is the newest complete checkpoint."""

    def __init__(self, path: str, step: int, latest: str, partial: str, cause: str, peer: bool = False):
        self.path, self.step, self.latest, self.partial, self.cause = path, step, latest, partial, cause
        self.peer = peer  # another rank hit it; this one lost its collective
        newest = f"step {latest.replace('global_step', '')}" if latest else "none (nothing was saved before)"
        super().__init__(f"disk full at {path} while saving step {step}; the newest complete checkpoint is {newest}")


def is_disk_full(exc: BaseException, path: Path) -> bool:
    """ENOSPC (or a quota), as an OSError or inside torch.save's RuntimeError ("file write failed"), or any
    failed write on a filesystem with less than 1 MiB left."""
    import errno
    import shutil

    seen: Optional[BaseException] = exc
    while seen is not None:  # the chain: torch and DeepSpeed re-raise
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(path).free < 2**20
    except OSError:
        return False


def record(run_dir: Path, rank: int, kind: str, **info: Any) -> Path:
    """Write this rank's fault record atomically (tmp + rename): kind is "oom" or "preempted"."""
    d = Path(run_dir) / FAULTS_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank{rank}.json"
    write_atomic(path, json.dumps({"kind": kind, "rank": rank, "time": time.time(), **info}, default=str))
    return path


NODE_KEY_ENV = "ZERORUN_NODE_KEY"
"""Set by zerorun for the ranks it launches on this node: a rank that finished cleanly leaves a marker under
this key, so zerorun need not wait for the launcher's own exit (see clean_exits)."""


def mark_clean_exit(run_dir: Path) -> None:
    """A rank's last act before a clean exit (everything written, the last barrier passed)."""
    key = os.environ.get(NODE_KEY_ENV)
    if key:
        (Path(run_dir) / FAULTS_DIR).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(run_dir) / FAULTS_DIR / f"exited-{key}-{os.environ.get('LOCAL_RANK', '0')}", "0\n")


def clean_exits(run_dir: Path, key: str) -> int:
    """How many of the ranks zerorun started under ``key`` have exited cleanly. The deepspeed CLI polls its
    ranks once a second and sleeps a second more before it exits (then tears down its imports, as the runner
    above it does): ~2 s per launch in which nothing is left to do."""
    return len(_exit_markers(run_dir, key))


def forget_clean_exits(run_dir: Path, key: str) -> None:
    """Once the launcher is gone: the markers said what they had to."""
    for p in _exit_markers(run_dir, key):
        p.unlink(missing_ok=True)


def _exit_markers(run_dir: Path, key: str) -> List[Path]:
    d = Path(run_dir) / FAULTS_DIR
    return list(d.glob(f"exited-{key}-*")) if d.is_dir() else []


def read_all(run_dir: Path) -> List[Dict[str, Any]]:
    """Every rank's fault record of the last attempt, by rank."""
    d = Path(run_dir) / FAULTS_DIR
    out = []
    for p in sorted(d.glob("rank*.json")) if d.is_dir() else []:
        try:
            out.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue  # a record is written by rename, so a torn one is not ours
    return sorted(out, key=lambda r: r.get("rank", 0))


def await_record(run_dir: Path, kind: str, timeout_s: float = 10.0, poll_s: float = 0.1) -> bool:
    """Whether some rank leaves a ``kind`` record within ``timeout_s``: a rank whose collective broke because a peer
    failed learns why (the peer writes its record as it leaves, which can be after this rank's error)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if any(r.get("kind") == kind for r in read_all(run_dir)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def clear(run_dir: Path) -> None:
    """Before an attempt: no record or stop request from the last one."""
    d = Path(run_dir) / FAULTS_DIR
    for p in d.glob("*") if d.is_dir() else []:
        p.unlink(missing_ok=True)
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


def request_stop(run_dir: Path, why: str) -> None:
    (Path(run_dir) / STOP_FILE).write_text(why + "\n")


def stop_requested(run_dir: Path) -> bool:
    return (Path(run_dir) / STOP_FILE).exists()

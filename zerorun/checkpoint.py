"""Crash-consistent DeepSpeed checkpoints.

DeepSpeed's own ``latest`` file is written by rank 0 before the other ranks finish their shards,
and its checkpoint holds no RNG state. So zerorun keeps its own protocol:

  every rank: engine.save_checkpoint(save_latest=False) + its own rng_rank{r}.pt
  barrier → rank 0 writes COMPLETE in the tag dir, then the ``zerorun_latest`` pointer (tmp + rename)
  → retention deletes the oldest complete tags beyond keep_last → barrier.

A tag without COMPLETE is never resumed from.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

LATEST = "zerorun_latest"
COMPLETE = "COMPLETE"


def tag_for(step: int) -> str:
    return f"global_step{step}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def complete_tags(root: Path) -> List[str]:
    """Complete checkpoint tags under root, oldest first."""
    if not root.is_dir():
        return []
    tags = [d.name for d in root.iterdir() if d.is_dir() and (d / COMPLETE).is_file()]
    return sorted(tags, key=lambda t: int(t.replace("global_step", "")) if t.replace("global_step", "").isdigit() else -1)


def latest_tag(root: Path) -> Optional[str]:
    """The tag zerorun_latest names if it is complete, else the newest complete tag."""
    pointer = root / LATEST
    if pointer.is_file():
        tag = pointer.read_text().strip()
        if (root / tag / COMPLETE).is_file():
            return tag
    tags = complete_tags(root)
    return tags[-1] if tags else None


def save(engine, root: Path, step: int, client_state: Dict[str, Any], *, rng_state: Dict[str, Any], rank: int,
         barrier: Callable[[], None], keep_last: int) -> str:
    import torch

    tag = tag_for(step)
    root.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    torch.save(rng_state, root / tag / f"rng_rank{rank}.pt")
    barrier()
    if rank == 0:
        _atomic_write(root / tag / COMPLETE, json.dumps({"step": step, **client_state}))
        _atomic_write(root / LATEST, tag)
        if keep_last > 0:
            for old in complete_tags(root)[:-keep_last]:
                shutil.rmtree(root / old, ignore_errors=True)
    barrier()
    return str(root / tag)


def load(engine, root: Path, tag: str, *, rank: int) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Load a complete tag into the engine; returns (client_state, this rank's RNG state)."""
    import torch

    if not (root / tag / COMPLETE).is_file():
        raise RuntimeError(f"checkpoint {root / tag} is incomplete (no {COMPLETE} marker); refusing to resume from it")
    path, client_state = engine.load_checkpoint(str(root), tag=tag)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    rng_file = root / tag / f"rng_rank{rank}.pt"
    # Our own file, written by this code: plain python/numpy RNG tuples need full unpickling.
    rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    return client_state, rng


def find_resume_point(candidates: List[Path]) -> Optional[Tuple[Path, str]]:
    """The first candidate checkpoint root (or run dir holding checkpoints/) with a complete tag."""
    for c in candidates:
        for root in (c / "checkpoints", c):
            tag = latest_tag(root)
            if tag:
                return root, tag
    return None

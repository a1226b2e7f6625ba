"""Crash-consistent DeepSpeed checkpoints.

DeepSpeed's own ``latest`` file is written by rank 0 before the other ranks finish their shards,
and its checkpoint holds no RNG state. So zerorun keeps its own protocol:

  every rank: engine.save_checkpoint(save_latest=False) + its own rng_rank{r}.pt
  barrier → rank 0 (with node-local checkpoints: local rank 0 of each node) writes COMPLETE in the tag dir (the step, the world that saved it, and a manifest:
  every file's size and SHA-256), then the ``zerorun_latest`` pointer (tmp + rename)
  → retention deletes the oldest complete tags beyond keep_last → barrier.

A tag without COMPLETE is never resumed from; one whose files differ from its manifest (a flipped byte, a
truncated or missing shard) is reported by name and the previous complete one is used (``resume_point``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from .manifest import manifest, mismatch, write_durably

LATEST = "zerorun_latest"
COMPLETE = "COMPLETE"


def tag_for(step: int) -> str:
    return f"global_step{step}"


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
         writer: bool, barrier: Callable[[], None], keep_last: int, world: Optional[Dict[str, int]] = None,
         at_point: Optional[Callable[[int], None]] = None, frozen_base: bool = False) -> str:
    """``at_point(k)`` is called at each numbered point of the save (tests kill or snapshot there). ``frozen_base``
    (adapter=lora): the frozen base weights are left out, the checkpoint holds the adapters and their states."""
    import torch

    tag = tag_for(step)
    point = at_point or (lambda k: None)
    root.mkdir(parents=True, exist_ok=True)
    point(0)
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=frozen_base)
    point(1)
    torch.save(rng_state, root / tag / f"rng_rank{rank}.pt")
    point(2)
    barrier()
    if writer:  # rank 0; with node-local checkpoints local rank 0 of each node, over that node's files
        marker = {"step": step, **client_state, "world": world or {},
                  "zero_stage": int(getattr(engine, "zero_optimization_stage", lambda: 0)()),
                  "files": manifest(root / tag, leave_out=[COMPLETE])}
        point(3)
        write_durably(root / tag / COMPLETE, json.dumps(marker))
        point(4)
        write_durably(root / LATEST, tag)
        point(5)
        if keep_last > 0:
            for old in complete_tags(root)[:-keep_last]:
                shutil.rmtree(root / old, ignore_errors=True)
    barrier()
    return str(root / tag)


def tags_held(max_steps: int, save_every: int, keep_last: int, start: int = 0, existing: int = 0) -> Tuple[int, int]:
    """(the most checkpoints on disk at once, those left when the export is written) for a run from step ``start``
    that finds ``existing`` complete ones (a resume): a save completes before retention deletes the oldest, so
    keep_last + 1 at once when the run saves that often."""
    def saves_up_to(step: int) -> int:
        return step // save_every if save_every else 0

    new = saves_up_to(max_steps) - saves_up_to(start) + (not save_every or max_steps % save_every != 0)
    if max_steps <= start:
        return existing, existing
    return max(existing + 1, min(existing + new, keep_last + 1)), min(existing + new, keep_last)


def space_problem(root: Path, need: int, export_root: Path, export_need: int,
                  free: Callable[[str], int], tags: Tuple[int, int] = (1, 1), existing: int = 0) -> Optional[str]:
    """Why the checkpoints this run keeps (and the export, when it lands on the same disk) would not fit, or None.
    ``need``: one checkpoint's bytes; ``tags``: ``tags_held``; ``existing``: complete ones already on that disk (a
    resume: their bytes are not free any more). ``free(path)``: free bytes on the filesystem holding path
    (hardware.free_disk_bytes)."""
    def device(p: Path) -> int:
        while not p.exists():
            p = p.parent
        return p.stat().st_dev

    def counted(n: int) -> str:
        return "one checkpoint" if n == 1 else f"{n} checkpoints (trainer.keep_last={tags[1]}" + \
            (", and one more while a save completes)" if n > tags[1] else ")")

    places = [(root, (tags[0] - existing) * need, "trainer.checkpoint_dir", counted(tags[0]))]
    if export_need:
        if device(export_root) == device(root):
            places = [places[0], (root, (tags[1] - existing) * need + export_need, "trainer.checkpoint_dir",
                                  counted(tags[1]) + " and the export")]
            places = [max(places, key=lambda p: p[1])]
        else:
            places.append((export_root, export_need, "trainer.export_dir", "the export"))
    gib = 2**30
    for path, bytes_needed, key, what in places:
        have = free(str(path))
        if have < bytes_needed:
            fewer = ", or a smaller trainer.keep_last" if "keep_last" in what else ""
            return (f"{path}: {have / gib:.2f} GiB free, {bytes_needed / gib:.2f} GiB needed for {what}. Fix: free "
                    f"space there, or point {key} at a larger disk{fewer}.")
    return None


def refuse_without_space(cfg, plan, params: int, run_dir, resume: Optional[Dict[str, Any]] = None) -> None:
    """Refuse (exit 2) a run whose checkpoints (as many as it keeps) and export would not fit where they go."""
    from . import hardware
    from .config import UserError
    from .memory import checkpoint_bytes, export_bytes

    tr, root = cfg.trainer, run_dir.checkpoints_for(cfg)
    start = int(marker(Path(resume["checkpoint_dir"]), resume["tag"]).get("step", 0)) if resume else 0
    existing = len(complete_tags(root))  # a resume's own (a fresh run's were refused or deleted by overwrite)
    problem = space_problem(root, checkpoint_bytes(cfg, plan, params), run_dir.export_for(cfg),
                            export_bytes(cfg, params), hardware.free_disk_bytes,
                            tags_held(tr.max_steps, tr.save_every, tr.keep_last, start, existing), existing)
    if problem:
        raise UserError(f"not enough disk space for the checkpoints: {problem}", key="trainer.checkpoint_dir")


NOT_ARCHITECTURE = ("name", "from_config_json", "name_or_path", "pretrained", "dropout")
"""model.* fields that leave the parameters' names and shapes as they are; every other one is the architecture."""


def identity(cfg) -> Dict[str, Any]:
    """What a checkpoint can be loaded into: the model's architecture, the adapter and the task (with its label
    count). Recorded in each checkpoint's COMPLETE (``run``); resume.py compares it before launch."""
    import dataclasses

    from .config.rules import resolve_task

    m, a = cfg.model, cfg.adapter
    task = resolve_task(cfg.task.name, m.family).value
    return {"model": m.name,
            "architecture": {f.name: getattr(m, f.name).value if hasattr(getattr(m, f.name), "value")
                             else getattr(m, f.name) for f in dataclasses.fields(m) if f.name not in NOT_ARCHITECTURE},
            "adapter": a.name.value if a.name.value == "none" else f"{a.name.value} r={a.r} on "
                       f"{','.join(a.target_modules) or 'the default modules'}",
            "task": task if task == "causal_lm" else f"{task} with {cfg.task.num_labels} labels"}


def identity_mismatch(saved: Dict[str, Any], now: Dict[str, Any]) -> Optional[str]:
    """Which of architecture, adapter and task differ between a checkpoint and this run, described; None: none."""
    differ = [k for k in ("architecture", "adapter", "task") if k in saved and saved[k] != now[k]]
    if not differ:
        return None
    was, arch = saved.get("architecture", {}), now["architecture"]
    fields = [f"model.{k} {was.get(k)} vs {v}" for k, v in arch.items() if k in was and was[k] != v]
    if "architecture" in differ and fields:
        differ[0] = f"architecture ({', '.join(fields[:4])})"

    def describe(i: Dict[str, Any]) -> str:
        return (f"{i.get('model', '?')} ({i.get('architecture', {}).get('family', '?')}, {i.get('task', '?')}, "
                f"adapter {i.get('adapter', '?')})")
    return f"{' and '.join(differ)} differ{'s' if len(differ) == 1 else ''}: the checkpoint is {describe(saved)}, this run is {describe(now)}"


def marker(root: Path, tag: str) -> Dict[str, Any]:
    try:
        return json.loads((root / tag / COMPLETE).read_text())
    except (OSError, ValueError):
        return {}


def damage(root: Path, tag: str) -> Optional[str]:
    """Why a complete tag cannot be trusted (the first file that differs from its manifest), or None.
    Checkpoints written before manifests existed pass unchecked."""
    tag_dir = root / tag
    if not (tag_dir / COMPLETE).is_file():
        return f"{tag_dir} has no {COMPLETE} marker (its save did not finish)"
    mark = marker(root, tag)
    if not mark:
        return f"{tag_dir / COMPLETE} is unreadable"
    return mismatch(tag_dir, mark.get("files") or {})


def load(engine, root: Path, tag: str, *, rank: int, frozen_base: bool = False
         ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """Load a complete tag into the engine; returns (client_state, this rank's RNG state). ``frozen_base``: the
    checkpoint holds the adapters only; the frozen base is the one the run built (same seed or weights)."""
    import torch

    if not (root / tag / COMPLETE).is_file():
        raise RuntimeError(f"checkpoint {root / tag} is incomplete (no {COMPLETE} marker); refusing to resume from it")
    path, client_state = engine.load_checkpoint(str(root), tag=tag, load_module_strict=not frozen_base)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    rng_file = root / tag / f"rng_rank{rank}.pt"
    # Our own file, written by this code: plain python/numpy RNG tuples need full unpickling.
    rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    return client_state, rng


def resume_point(candidates: List[Path]) -> Tuple[Optional[Tuple[Path, str]], List[str]]:
    """The newest complete, undamaged checkpoint of the first candidate that has complete ones, and why
    each newer complete one was passed over (the launcher prints them; when nothing is left, the error)."""
    for c in candidates:
        for root in (c / "checkpoints", c):
            tags = complete_tags(root)
            if not tags:
                continue
            newest = latest_tag(root)
            order = [newest] + [t for t in reversed(tags) if t != newest]
            skipped = []
            for tag in order:
                problem = damage(root, tag)
                if problem is None:
                    return (root, tag), skipped
                skipped.append(problem)
            return None, skipped
    return None, []


UNIVERSAL = "checkpoints_universal"
"""Beside checkpoints/: saved tags converted to DeepSpeed's universal format, for another data-parallel size."""


def to_universal(root: Path, tag: str, out_root: Path, env: Dict[str, str]) -> Path:
    """Convert a ZeRO ≥ 1 tag (optimizer states sharded over the saving ranks) with DeepSpeed's own tool
    (deepspeed.checkpoint.ds_to_universal) so any number of ranks can load it (ds_config
    ``checkpoint.load_universal``) into ``out_root/tag`` (the resuming run's checkpoints_universal/), with its
    own COMPLETE and manifest, so it is trusted like any save. Converted once per tag; returns out_root."""
    target = out_root / tag
    if damage(out_root, tag) is None:
        return out_root
    partial = out_root / f"{tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    out_root.mkdir(parents=True, exist_ok=True)
    # --inject_missing_state: a plain (non-Megatron) module saves no universal_checkpoint_info.
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(root / tag), "--output_folder", str(partial), "--inject_missing_state",
                           "--num_extract_workers", "1", "--num_merge_workers", "1"],
                          env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"converting {root / tag} to a universal checkpoint failed:\n{proc.stdout[-2000:]}")
    (out_root / "latest_universal").unlink(missing_ok=True)  # the tool's pointer; zerorun names the tag
    for rng in (root / tag).glob("rng_rank*.pt"):
        shutil.copy2(rng, partial / rng.name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    mark = {**marker(root, tag), "universal": True, "converted_from": str(root / tag)}
    mark["files"] = manifest(target)
    write_durably(target / COMPLETE, json.dumps(mark))
    return out_root

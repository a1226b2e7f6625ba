"""Every path a config names, checked before launch by what its field declares (schema.py ``path_field``):
an input file exists, is a file and can be read; a directory zerorun writes to exists or can be made and takes
a file; a resume source is a directory; a tokenizer is a directory or a hub name. Each problem names the key,
the path and what to do. What a resume source must hold (a complete checkpoint) is resume.py's to say."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, List, Optional

from .errors import UserError
from .fields import PathKind, leaves
from .schema import OffloadDevice, RunConfig

HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
"""A Hugging Face repo id: ``name`` or ``owner/name`` (huggingface_hub's validate_repo_id, in short)."""

FIXES = {
    PathKind.file: "give the path of a readable file.",
    PathKind.out_dir: "point it at a directory you can write to (it is created if missing).",
    PathKind.resume: "trainer.resume_from=<a run dir or checkpoint dir of an earlier run>, or drop it to start over.",
    PathKind.source: "a local directory with the files, or a hub name (owner/name) when online.",
}
KEY_FIXES = {"offload.nvme_path": "point it at a directory on a local NVMe disk you can write to."}


def _unused(cfg: RunConfig, key: str) -> bool:
    """Paths whose setting has no effect on this run are not looked at (an unused default must not refuse)."""
    return {"offload.nvme_path": cfg.offload.device != OffloadDevice.nvme,
            "model.name_or_path": True,  # models.pretrained_problems: weights are found where they are read
            "launcher.hostfile": True,   # hostfile.problems reads and parses it
            "data.tokenizer": cfg.data.tokenizer == "auto"}.get(key, False)


def file_problem(path: str) -> Optional[str]:
    p = Path(path).expanduser()
    if not p.exists():
        return "no such file"
    if p.is_dir():
        return "is a directory, not a file"
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    return None


def looks_local(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~", "pkg://")) or value in (".", "..") or os.path.exists(value)


def source_problem(value: str) -> Optional[str]:
    """A tokenizer (or checkpoint) source: an existing local directory, or something the hub could answer."""
    if value.startswith("pkg://"):
        return None  # models.resolve_pkg_path names the package when it is missing
    if looks_local(value):
        p = Path(value).expanduser()
        if not p.exists():
            return "no such directory"
        if not p.is_dir():
            return "is a file; a tokenizer or checkpoint is a directory (tokenizer.json, config.json, ...)"
        return None
    if not HUB_NAME.match(value) or "--" in value or ".." in value:
        return "is neither a local directory nor a Hugging Face hub name (owner/name)"
    return None


def resume_problem(path: str) -> Optional[str]:
    p = Path(path).expanduser()
    if not p.exists():
        return "no such directory"
    if not p.is_dir():
        return "is a file, not a run dir or checkpoint dir"
    return None


def path_problems(cfg: RunConfig, writable: Callable[[str], Optional[str]]) -> List[UserError]:
    """Every path field of ``cfg`` that is set, used by this run, and wrong. ``writable(path)``: None when a
    directory can be made and written there, else why not (hardware.writable_dir_problem tries it)."""
    def out_dir_problem(value: str) -> Optional[str]:
        why = writable(os.path.expanduser(value))
        return f"not a writable directory ({why})" if why else None

    checks = {PathKind.file: file_problem, PathKind.out_dir: out_dir_problem, PathKind.resume: resume_problem,
              PathKind.source: source_problem}
    out = []
    for key, f, value in leaves(cfg):
        kind = f.metadata.get("path")
        if kind is None or not value or _unused(cfg, key):
            continue
        if "\x00" in value:  # no filesystem call takes it (ValueError, not OSError)
            why = "contains a NUL byte, which no path can hold"
        else:
            why = checks[kind](value) if kind in checks else None
        if why:
            out.append(UserError(f"{key}={value}: {why}.", KEY_FIXES.get(key, FIXES[kind]), key=key, value=value))
    return out

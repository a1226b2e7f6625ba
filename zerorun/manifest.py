"""What a directory of files zerorun wrote held when it was published (each file's size and SHA-256), and
whether it still does. Checkpoints (COMPLETE) and caches (tokenized data, tokenizer) are trusted only when
their files match: a truncated copy, a full disk or a flipped byte is named, never loaded."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Dict, Iterable, Optional


def digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest(root: Path, leave_out: Iterable[str] = ()) -> Dict[str, Dict[str, Any]]:
    """Every file under ``root`` (relative path → size, SHA-256), the names in ``leave_out`` left out."""
    skip = set(leave_out)
    return {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": digest(p)}
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


def mismatch(root: Path, files: Dict[str, Dict[str, Any]], digest_up_to: Optional[int] = None) -> Optional[str]:
    """The first file under ``root`` that differs from ``files`` (a manifest), as a phrase, or None. Files
    larger than ``digest_up_to`` bytes are compared by size only (None: every file by its SHA-256 too)."""
    for rel, want in files.items():
        path = root / rel
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path} is {size} bytes, {want['bytes']} were written (truncated or replaced)"
        if (digest_up_to is None or size <= digest_up_to) and digest(path) != want["sha256"]:
            return f"{path} does not match the SHA-256 recorded when it was written (corrupted)"
    return None


def write_durably(path: Path, text: str) -> None:
    """``text`` into ``path`` all or nothing: a temporary file, fsync, rename, fsync of the directory."""
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

"""Composed configs kept on disk, so a repeated ``zerorun-estimate`` skips Hydra.

Importing Hydra and OmegaConf and composing is ~0.2 s of a warm estimate's ~0.45 s; the RunConfig it yields is a
pure function of the overrides, zerorun's own files (the schema, conf/ and the model files), the Hydra and
OmegaConf installed (and transformers, torch and peft, which read a config.json's architecture), the home
directory (``~`` is expanded) and, for ``+model=hf``, the config.json it read. The key covers all but the last;
the entry records that by size and mtime and is ignored when it changed. A config.json read from the hub, an
override with an interpolation (``${...}``, which may read the environment) or a Hydra setting is never cached.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import sys
from typing import Callable, List, Optional, Sequence, Tuple

from ..cachedir import cache_root
from .schema import RunConfig

Stamp = Tuple[str, int, int]  # (path, size, mtime_ns)
VERSION = 1  # bump when the entry's layout changes


def cache_dir() -> str:
    return os.path.join(cache_root(), "compose")


def stamp(path: str) -> Optional[Stamp]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (path, st.st_size, st.st_mtime_ns)


def _tree_stamps(root: str) -> List[Stamp]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        out += [s for name in sorted(filenames) if not name.endswith(".pyc")
                for s in [stamp(os.path.join(dirpath, name))] if s]
    return out


def source_roots() -> List[str]:
    """zerorun's code and its conf/ (a package of its own, outside zerorun/ in a checkout)."""
    conf = importlib.util.find_spec("zerorun.conf")
    return [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            *((conf.submodule_search_locations or []) if conf else [])]


def key(overrides: Sequence[str]) -> str:
    """What the composition depends on besides a checkpoint's config.json (1-2 ms: ~100 stats)."""
    libs = [importlib.util.find_spec(name) for name in ("hydra", "omegaconf", "transformers", "torch", "peft")]
    parts = [str(VERSION), sys.version, os.path.expanduser("~"), repr(list(overrides)),
             repr([_tree_stamps(root) for root in source_roots()]),
             repr([stamp(s.origin) if s and s.origin else None for s in libs])]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def cacheable(overrides: Sequence[str]) -> bool:
    """Not with an interpolation (it may read the environment) or a Hydra setting (a search path adds files)."""
    return not any("${" in o or o.lstrip("+~").startswith("hydra") for o in overrides)


def load(entry_key: str) -> Optional[RunConfig]:
    """The RunConfig stored under ``entry_key``, or None (absent, unreadable, or a file it read has changed)."""
    try:
        with open(os.path.join(cache_dir(), entry_key + ".pkl"), "rb") as f:
            files, cfg = pickle.load(f)
    except Exception:  # noqa: BLE001 (absent, truncated, written by another zerorun: recompose)
        return None
    if not isinstance(cfg, RunConfig) or any(stamp(s[0]) != tuple(s) for s in files):
        return None
    return cfg


def store(entry_key: str, cfg: RunConfig, files: Sequence[str]) -> None:
    """Keep ``cfg`` with the stamps of the files it was read from; a cache that cannot be written is skipped."""
    stamps = [stamp(p) for p in files]
    if any(s is None for s in stamps):
        return
    path = os.path.join(cache_dir(), entry_key + ".pkl")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump((stamps, cfg), f)
        os.replace(tmp, path)  # readers see the old entry or the new one, never half of one
    except OSError:
        return


def cached(overrides: Sequence[str],
           compose: Callable[[Sequence[str], List[Optional[str]]], RunConfig]) -> RunConfig:
    """``compose(overrides, files_read)`` once per key: it appends the local files it read to ``files_read`` and
    None for a read the cache cannot stamp (the hub)."""
    if not cacheable(overrides):
        return compose(overrides, [])
    entry_key = key(overrides)
    hit = load(entry_key)
    if hit is not None:
        return hit
    files: List[Optional[str]] = []
    cfg = compose(overrides, files)
    if all(files):
        store(entry_key, cfg, files)
    return cfg

"""Every path a config names, checked before launch by what its field declares (schema.py ``path_field``):
an input file exists, is a regular file (its kind read from its mode first, so a named pipe is never opened)
and can be read; a directory zerorun writes to exists or can be made and takes
a file; a resume source is a directory; a tokenizer is a directory or a hub name. Each problem names the key,
the path and what to do. ``~`` and ``~user`` are expanded once, when the config is loaded (``expanded``); a
user this machine does not know is one error line. What a resume source must hold (a complete checkpoint) is resume.py's to say."""
from __future__ import annotations

import dataclasses
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional

from ..cachedir import CACHE_ENV
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
KEY_FIXES = {"offload.nvme_path": "point it at a directory on a local NVMe disk you can write to.",
             "data.tokenizer": "point data.tokenizer at a directory a tokenizer was saved to (save_pretrained), a hub "
                               "name when online, or data.tokenizer=auto (a byte-level BPE sized to the model's "
                               "vocabulary, trained on the data)."}


def _unused(cfg: RunConfig, key: str) -> bool:
    """Paths whose setting has no effect on this run are not looked at (an unused default must not refuse)."""
    return {"offload.nvme_path": cfg.offload.device != OffloadDevice.nvme,
            "model.name_or_path": True,  # models.pretrained_problems: weights are found where they are read
            "launcher.hostfile": True,   # hostfile.problems reads and parses it
            "data.tokenizer": cfg.data.tokenizer == "auto"}.get(key, False)


def expand(path: str) -> str:
    """``~`` and ``~user`` expanded; a user this machine does not know leaves the path as it is (``home_problem``
    names it), where ``Path.expanduser`` raises RuntimeError."""
    return os.path.expanduser(path)


def home_problem(path: str) -> Optional[str]:
    """Why ``~user/...`` cannot be expanded (no such user, or no home for ``~``), or None."""
    if not path.startswith("~") or expand(path) != path:
        return None
    user = path[1:].split("/", 1)[0]
    return (f"names the home directory of user '{user}', which this machine does not know" if user
            else "starts with ~, but this process has no home directory ($HOME is unset)")


KINDS = {stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory", stat.S_IFREG: "a regular file"}


def kind_of(path: str) -> Optional[str]:
    """What is at ``path`` (following links), from its mode alone, so a FIFO is never opened; None: nothing."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return KINDS.get(stat.S_IFMT(mode), "not a regular file")


def expanded(cfg: Any) -> Any:
    """``cfg`` (a schema dataclass) with every path field's ``~`` expanded (safely: see ``expand``)."""
    changes = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            changes[f.name] = expanded(value)
        elif f.metadata.get("path") is not None and isinstance(value, str) and value.startswith("~"):
            changes[f.name] = expand(value)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def file_problem(path: str) -> Optional[str]:
    p = Path(expand(path))
    kind = kind_of(str(p))
    if kind is None:
        return "no such file"
    if kind == KINDS[stat.S_IFDIR]:
        return "is a directory, not a file"
    if kind != KINDS[stat.S_IFREG]:
        return f"is {kind}, not a regular file"
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
        kind = kind_of(expand(value))
        if kind is None:
            return "no such directory"
        if kind != KINDS[stat.S_IFDIR]:
            return f"is {kind}; a tokenizer or checkpoint is a directory (tokenizer.json, config.json, ...)"
        return None
    if not HUB_NAME.match(value) or "--" in value or ".." in value:
        return "is neither a local directory nor a Hugging Face hub name (owner/name)"
    return None


TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("spiece.model",), ("sentencepiece.bpe.model",),
                   ("vocab.txt",), ("vocab.json", "merges.txt"), ("tiktoken.model",))
"""What a saved tokenizer holds, one of these sets in full: the fast tokenizer's tokenizer.json; a SentencePiece
model (Llama, T5, XLM-R); WordPiece's vocab.txt (BERT); byte-level BPE's vocab.json and merges.txt (GPT-2,
RoBERTa); a tiktoken file. tokenizer_config.json alone is not one: it names a class, not a vocabulary."""


def has_tokenizer(path: str) -> bool:
    """Whether the directory ``path`` holds a tokenizer (``TOKENIZER_FILES``): stat calls, nothing loaded."""
    return any(all(os.path.isfile(os.path.join(path, f)) for f in files) for files in TOKENIZER_FILES)


def tokenizer_problem(value: str) -> Optional[str]:
    """data.tokenizer: ``source_problem``, and a local directory must hold a tokenizer."""
    why = source_problem(value)
    if why or value.startswith("pkg://") or not looks_local(value) or has_tokenizer(expand(value)):
        return why
    return ("holds no tokenizer (" + ", ".join(" + ".join(f) for f in TOKENIZER_FILES[:6]) + ")")


def resume_problem(path: str) -> Optional[str]:
    kind = kind_of(expand(path))
    if kind is None:
        return "no such directory"
    if kind != KINDS[stat.S_IFDIR]:
        return f"is {'a file' if kind == KINDS[stat.S_IFREG] else kind}, not a run dir or checkpoint dir"
    return None


def dir_kind_problem(path: str) -> Optional[str]:
    """Something other than a directory where zerorun would write into one, or None."""
    kind = kind_of(expand(path))
    return None if kind in (None, KINDS[stat.S_IFDIR]) else f"is {kind}, not a directory"


KEY_CHECKS = {"data.tokenizer": tokenizer_problem}


def path_problems(cfg: RunConfig, writable: Callable[[str], Optional[str]],
                  environ: Optional[Mapping[str, str]] = None) -> List[UserError]:
    """Every path field of ``cfg`` that is set, used by this run, and wrong, and $ZERORUN_CACHE when it stands
    for data.cache_dir. ``writable(path)``: None when a directory can be made and written there, else why not
    (hardware.writable_dir_problem tries it). ``environ``: os.environ unless given."""
    def out_dir_problem(value: str) -> Optional[str]:
        why = dir_kind_problem(value) or writable(expand(value))
        return f"not a writable directory ({why})" if why else None

    checks = {PathKind.file: file_problem, PathKind.out_dir: out_dir_problem, PathKind.resume: resume_problem,
              PathKind.source: source_problem}

    def problem(value: str, check: Callable[[str], Optional[str]], fix: str) -> Optional[tuple]:
        """(why, fix) for one path, or None; a path that cannot be looked at says so before any look."""
        if "\x00" in value:  # no filesystem call takes it (ValueError, not OSError)
            return "contains a NUL byte, which no path can hold", fix
        if home_problem(value):
            return home_problem(value), "write the path out in full (/home/<user>/...)."
        why = check(value)
        return (why, fix) if why else None

    out = []
    for key, f, value in leaves(cfg):
        kind = f.metadata.get("path")
        if kind is None or not value or _unused(cfg, key) or kind not in checks:
            continue
        found = problem(value, KEY_CHECKS.get(key, checks[kind]), KEY_FIXES.get(key, FIXES[kind]))
        if found:
            out.append(UserError(f"{key}={value}: {found[0]}.", found[1], key=key, value=value))
    cache = (os.environ if environ is None else environ).get(CACHE_ENV, "")
    found = problem(cache, out_dir_problem, f"point {CACHE_ENV} at a directory you can write to, unset it "
                    "(~/.cache/zerorun), or set data.cache_dir.") if cache and not cfg.data.cache_dir else None
    if found:
        out.append(UserError(f"{CACHE_ENV}={cache} (where tokenized data is cached): {found[0]}.", found[1],
                             key=CACHE_ENV, value=cache))
    return out

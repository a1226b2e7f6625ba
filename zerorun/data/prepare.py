"""Launcher side: corpus → tokenizer → packed token blocks or encoded examples, prepared once.

The launcher process prepares everything here and writes it to a cache keyed by its inputs, so
bad data fails before launch (exit 2) and a second run does not tokenize again. Ranks only
memory-map the prepared arrays (loader.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np

from ..config import DataConfig, DataError, ModelConfig, TaskName
from ..cachedir import cache_root as default_cache_root
from ..config.paths import expand, has_tokenizer
from ..config.rules import BUILTIN_DATASETS
from ..manifest import manifest, mismatch, write_durably
from ..models import resolve_pkg_path
from .builtin import builtin_rows
from .readers import load_hub, read_labelled, read_lm_texts

# --------------------------------------------------------------------------------------------
# Tokenizer


def train_bpe_tokenizer(docs: List[str], vocab_size: int, out_dir: Path):
    """A byte-level BPE (GPT-2 style) trained on the corpus: no download needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(spec: str):
    """A tokenizer from a local directory or a hub name, with an actionable error offline."""
    from transformers import AutoTokenizer

    from ..models import hub_reachable

    try:
        return AutoTokenizer.from_pretrained(spec, local_files_only=not os.path.isdir(spec) and not hub_reachable())
    except (OSError, ValueError) as e:  # ValueError: huggingface_hub's HFValidationError for a malformed name
        raise DataError(
            f"tokenizer '{spec}' could not be loaded ({_first_line(e)}). Fix: with no network, point "
            "data.tokenizer (or model.name_or_path) at a local tokenizer directory, or use data.tokenizer=auto "
            "with model.pretrained=false.", key="data.tokenizer", value=spec
        ) from None
    except ImportError as e:  # a slow tokenizer's converter needs sentencepiece or protobuf (pip install zerorun has both)
        raise DataError(
            f"tokenizer '{spec}' needs a package this environment lacks ({_first_line(e)}). Fix: pip install "
            "sentencepiece protobuf, or point data.tokenizer at a directory with a tokenizer.json.",
            key="data.tokenizer", value=spec) from None
    except (AttributeError, TypeError, KeyError) as e:  # transformers on files it cannot read as any tokenizer
        raise DataError(
            f"tokenizer '{spec}' could not be read as a tokenizer ({type(e).__name__}: {_first_line(e)}). Fix: point "
            "data.tokenizer at a directory a tokenizer was saved to (save_pretrained), or data.tokenizer=auto.",
            key="data.tokenizer", value=spec) from None


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


# --------------------------------------------------------------------------------------------
# Packing and preparation


def pack(token_lists: List[List[int]], seq_len: int, eos_id: int) -> np.ndarray:
    """Concatenate documents separated by EOS and cut into [N, seq_len] blocks: no padding waste.

    The tail shorter than one block is dropped.
    """
    flat: List[int] = []
    for ids in token_lists:
        flat.extend(ids)
        flat.append(eos_id)
    n = len(flat) // seq_len
    return np.asarray(flat[: n * seq_len], dtype=np.int32).reshape(n, seq_len)


@dataclass
class Prepared:
    """Where the prepared data lives; written into the run dir as prepared.json."""

    task: str  # causal_lm | sequence_classification
    train: str
    val: str
    tokenizer_dir: str
    vocab_size: int
    num_train: int
    num_val: int
    seq_len: int
    cache_key: str
    pad_id: int = 0
    label_names: List[str] = field(default_factory=list)
    source: str = ""
    cached: bool = False
    longest: int = 0
    """Classification: the longest example in tokens after truncation, so the longest padded batch (batches are
    padded to their own longest row); 0 for packed LM blocks, which are always ``seq_len`` long."""

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, run_dir: Path) -> None:
        (run_dir / "prepared.json").write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, run_dir: Path) -> "Prepared":
        return cls(**json.loads((run_dir / "prepared.json").read_text()))


    @classmethod
    def from_json(cls, d: dict) -> "Prepared":
        return cls(**d)


MANIFEST = "MANIFEST.json"
DIGEST_UP_TO = 256 * 2**20
"""Cache files up to this size are checked against their SHA-256 at every launch (a 256 MiB file: ~0.3 s);
larger ones by size only."""


def cache_root(data: DataConfig) -> Path:
    return Path(expand(data.cache_dir or default_cache_root()))


def builtin_name(data: DataConfig, task: str) -> str:
    """The built-in data set used when no file or hub dataset is given."""
    return data.name if data.name != "auto" else BUILTIN_DATASETS[TaskName(task)]


def _file_fingerprint(path: str, key: str = "data.path") -> dict:
    if not os.path.isfile(path):
        raise DataError(f"{key}={path}: no such file.", "give a readable .txt, .jsonl or .csv file.", key=key,
                        value=path)
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime": st.st_mtime_ns}


def _source_fingerprint(data: DataConfig, task: str, seed: int) -> dict:
    if data.hf_dataset:
        return {"hf": data.hf_dataset, "config": data.hf_config_name, "splits": [data.hf_train_split, data.hf_val_split]}
    if not data.path:
        return {"builtin": builtin_name(data, task), "docs": data.synthetic_docs, "seed": seed, "version": 2}
    fp = {"train": _file_fingerprint(data.path)}
    if data.val_path:
        fp["val"] = _file_fingerprint(data.val_path, "data.val_path")
    return fp


def tokenizer_spec(data: DataConfig, model: ModelConfig) -> str:
    """Which tokenizer to use. auto: the checkpoint's own when it can be read here (pretrained,
    or a local/packaged checkpoint that holds one), the bundled BERT-uncased WordPiece for the BERT family,
    else a byte-level BPE trained on the corpus, sized to the model's vocabulary. A local directory with a
    config.json alone (no tokenizer files) is planned and trained from like random init; pretrained weights
    without their tokenizer are refused (one line naming data.tokenizer)."""
    if data.tokenizer != "auto":
        return data.tokenizer
    local = bool(model.name_or_path) and os.path.isdir(expand(model.name_or_path))
    if local and not has_tokenizer(expand(model.name_or_path)):
        if model.pretrained:
            raise DataError(
                f"data.tokenizer=auto with model.pretrained=true uses the checkpoint's own tokenizer, but "
                f"model.name_or_path={model.name_or_path} holds none. Fix: data.tokenizer=<the directory or hub name "
                "of the tokenizer these weights were trained with>, or save it beside them (save_pretrained).",
                key="data.tokenizer", value=data.tokenizer)
    elif model.name_or_path and (model.pretrained or model.name_or_path.startswith("pkg://") or local):
        return model.name_or_path
    from ..arch import bundled_tokenizer

    if bundled_tokenizer(model):
        return bundled_tokenizer(model)
    return f"bpe:{min(data.tokenizer_vocab, model.vocab_size)}"


def _load_rows(data: DataConfig, task: str, num_labels: int, seed: int):
    """(train, val, label_names) where rows are texts (LM) or (text, label) pairs."""
    name = builtin_name(data, task)
    if data.hf_dataset:
        return load_hub(data, task, num_labels)
    if not data.path:
        return builtin_rows(name, TaskName(task), num_labels, data.synthetic_docs, seed)
    if task == "causal_lm":
        val = read_lm_texts(data.val_path, data.format, data.text_column) if data.val_path else None
        return read_lm_texts(data.path, data.format, data.text_column), val, []
    train, names = read_labelled(data.path, data.format, data.text_column, data.label_column, num_labels)
    val = None
    if data.val_path:
        val, val_names = read_labelled(data.val_path, data.format, data.text_column, data.label_column, num_labels)
        if val_names != names:
            raise DataError(f"{data.val_path}: labels {val_names} differ from {data.path}'s {names}.")
    return train, val, names


def _split(rows: list, val_fraction: float, seed: int):
    """Carve a validation split (whole documents/examples) with the seed."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_val = int(round(len(rows) * val_fraction))
    if val_fraction > 0:
        n_val = max(1, n_val)
    return [rows[i] for i in order[n_val:]], [rows[i] for i in order[:n_val]]


def _say(msg: str) -> None:
    print(f"zerorun: {msg}", file=sys.stderr, flush=True)


def cached_entry_problem(out: Path) -> Optional[str]:
    """Why a cache entry cannot be trusted (no manifest: an older or unfinished write; a file that differs
    from it: a truncated copy, a full disk), or None."""
    try:
        files = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{out / MANIFEST} is missing or unreadable"
    return mismatch(out, files, digest_up_to=DIGEST_UP_TO)


def prepare(data: DataConfig, model: ModelConfig, seed: int, task: str = "causal_lm",
            num_labels: int = 2, log=_say) -> Prepared:
    """Read, tokenize and pack/encode the data once (or reuse the cache). Raises DataError on bad input."""
    spec = tokenizer_spec(data, model)
    key_src = {"source": _source_fingerprint(data, task, seed), "tokenizer": spec, "seq_len": data.seq_len,
               "val_fraction": data.val_fraction, "seed": seed, "format": data.format.value, "task": task,
               "num_labels": num_labels, "columns": [data.text_column, data.label_column], "version": 2}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    label = builtin_name(data, task) if not data.path else Path(data.path).stem
    out = cache_root(data) / "data" / f"{label}-{key}"
    if out.is_dir():
        damaged = cached_entry_problem(out)
        if damaged is None:
            prepared = Prepared.load(out)
            prepared.cached = True
            if task != "causal_lm" and not prepared.longest:  # written before the field existed
                prepared.longest = max(longest_row(prepared.train), longest_row(prepared.val))
            return prepared
        log(f"the tokenized-data cache does not match its manifest ({damaged}): rebuilding it")
        shutil.rmtree(out, ignore_errors=True)

    train_rows, val_rows, label_names = _load_rows(data, task, num_labels, seed)
    if val_rows is None:
        train_rows, val_rows = _split(train_rows, data.val_fraction, seed)
    source = data.hf_dataset or data.path or f"built-in {label}"
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    texts = train_rows if task == "causal_lm" else [t for t, _ in train_rows]
    if spec.startswith("bpe:"):
        tokenizer = train_bpe_tokenizer(texts, int(spec[4:]), tmp / "tokenizer")
    else:
        tokenizer = load_tokenizer(resolve_pkg_path(spec))
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
    if len(tokenizer) > model.vocab_size:
        raise DataError(
            f"tokenizer '{spec}' has {len(tokenizer)} tokens but model.vocab_size={model.vocab_size}. "
            "Fix: a tokenizer that matches the model, or model.vocab_size large enough."
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if task == "causal_lm":
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        encode = lambda ds: tokenizer(ds, add_special_tokens=False)["input_ids"] if ds else []  # noqa: E731
        train, val = pack(encode(train_rows), data.seq_len, eos), pack(encode(val_rows), data.seq_len, eos)
        n_train, n_val = len(train), len(val)
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        files = ("train.npy", "val.npy")
    else:
        n_train, n_val = len(train_rows), len(val_rows)
        for split, rows in (("train", train_rows), ("val", val_rows)):
            ids = tokenizer([t for t, _ in rows], truncation=True, max_length=data.seq_len)["input_ids"] if rows else []
            save_ragged(tmp / f"{split}.npz", ids, [lab for _, lab in rows])
        files = ("train.npz", "val.npz")
    if n_train == 0:
        raise DataError(f"{source}: too little data for one training sequence of data.seq_len={data.seq_len} "
                        "tokens. Fix: more data or a smaller data.seq_len.")
    prepared = Prepared(task=task, train=str(out / files[0]), val=str(out / files[1]),
                        tokenizer_dir=str(out / "tokenizer"), vocab_size=len(tokenizer), num_train=n_train,
                        num_val=n_val, seq_len=data.seq_len, cache_key=key, pad_id=int(pad_id),
                        label_names=label_names, source=source,
                        longest=0 if task == "causal_lm" else max(longest_row(tmp / f) for f in files))
    prepared.save(tmp)
    write_durably(tmp / MANIFEST, json.dumps(manifest(tmp)))  # last: what a reader checks before trusting it
    try:
        os.replace(tmp, out)  # atomic publish: a concurrent or killed run never sees half a cache entry
    except OSError:  # another process published the same key first
        shutil.rmtree(tmp, ignore_errors=True)
    return prepared


def longest_row(path) -> int:
    """The longest row of a ragged split (save_ragged), in tokens; 0 when it has none."""
    offsets = np.load(path)["offsets"]
    return int(np.diff(offsets).max()) if len(offsets) > 1 else 0


def save_ragged(path: Path, ids: List[List[int]], labels: List[int]) -> None:
    lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.asarray([t for x in ids for t in x], dtype=np.int32)
    np.savez(path, ids=flat, offsets=offsets, labels=np.asarray(labels, dtype=np.int64))


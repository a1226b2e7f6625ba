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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Tuple

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

    train: str
    val: str
    tokenizer_dir: str
    vocab_size: int
    num_train: int
    num_val: int
    seq_len: int
    cache_key: str
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


def _source_fingerprint(data: DataConfig, seed: int) -> dict:
    if not data.path:
        return {"synthetic_docs": data.synthetic_docs, "seed": seed, "version": 1}
    st = os.stat(data.path)
    return {"path": os.path.abspath(data.path), "size": st.st_size, "mtime": st.st_mtime_ns}


def _tokenizer_spec(data: DataConfig, model: ModelConfig) -> str:
    if data.tokenizer != "auto":
        return data.tokenizer
    if model.pretrained:
        return model.name_or_path
    return f"bpe:{min(data.tokenizer_vocab, model.vocab_size)}"


def prepare(data: DataConfig, model: ModelConfig, seed: int) -> Prepared:
    """Tokenize and pack the corpus (or reuse the cache). Raises DataError on bad input."""
    spec = _tokenizer_spec(data, model)
    key_src = {"source": _source_fingerprint(data, seed), "tokenizer": spec, "seq_len": data.seq_len,
               "val_fraction": data.val_fraction, "seed": seed, "format": data.format,
               "text_column": data.text_column, "version": 1}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    out = cache_root(data) / "data" / f"{data.name}-{key}"
    meta = out / "prepared.json"
    if meta.is_file():
        prepared = Prepared.load(out)
        prepared.cached = True
        return prepared

    docs = synthetic_corpus(data.synthetic_docs, seed) if not data.path else read_lm_texts(
        data.path, data.format, data.text_column)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok_dir = tmp / "tokenizer"
    if spec.startswith("bpe:"):
        tokenizer = train_bpe_tokenizer(docs, int(spec[4:]), tok_dir)
    else:
        tokenizer = load_tokenizer(spec)
        tokenizer.save_pretrained(str(tok_dir))
    if len(tokenizer) > model.vocab_size:
        raise DataError(
            f"tokenizer '{spec}' has {len(tokenizer)} tokens but model.vocab_size={model.vocab_size}. "
            "Fix: a tokenizer that matches the model, or model.vocab_size large enough."
        )
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    # Split documents (not blocks) so no validation text leaks into training blocks.
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_val = int(round(len(docs) * data.val_fraction))
    if data.val_fraction > 0:
        n_val = max(1, n_val)
    val_docs = [docs[i] for i in order[:n_val]]
    train_docs = [docs[i] for i in order[n_val:]]
    encode = lambda ds: tokenizer(ds, add_special_tokens=False)["input_ids"] if ds else []  # noqa: E731
    train = pack(encode(train_docs), data.seq_len, eos)
    val = pack(encode(val_docs), data.seq_len, eos)
    if len(train) == 0:
        raise DataError(
            f"{data.path or 'synthetic corpus'}: too little text for one sequence of data.seq_len={data.seq_len} tokens. "
            "Fix: more data or a smaller data.seq_len."
        )
    np.save(tmp / "train.npy", train)
    np.save(tmp / "val.npy", val)
    prepared = Prepared(train=str(out / "train.npy"), val=str(out / "val.npy"), tokenizer_dir=str(out / "tokenizer"),
                        vocab_size=len(tokenizer), num_train=len(train), num_val=len(val), seq_len=data.seq_len,
                        cache_key=key)
    prepared.save(tmp)
    try:
        os.replace(tmp, out)  # atomic publish: a concurrent or killed run never sees half a cache entry
    except OSError:  # another process published the same key first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return prepared


# --------------------------------------------------------------------------------------------
# Per-rank sampling


class RankSampler:
    """Shuffled, disjoint micro-batches per data-parallel rank, resumable from a sample count.

    Epoch e uses the permutation seeded by (seed, e); rank r takes every world-th index of it.
    The state is just ``consumed`` (micro-batches drawn by this rank), so resume is exact.
    """

    def __init__(self, n: int, rank: int, world: int, micro_batch: int, seed: int):
        self.n, self.rank, self.world, self.micro, self.seed = n, rank, world, micro_batch, seed
        self.per_rank = n // world  # equal shards; the remainder is dropped each epoch
        if self.per_rank < micro_batch:
            raise DataError(
                f"{n} training sequences are too few for {world} ranks × micro-batch {micro_batch}. "
                "Fix: more data, a smaller data.seq_len or a smaller trainer.micro_batch_size."
            )
        self.batches_per_epoch = self.per_rank // micro_batch
        self.consumed = 0
        self._epoch_cache: Tuple[int, Optional[np.ndarray]] = (-1, None)

    def _shard(self, epoch: int) -> np.ndarray:
        if self._epoch_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch_cache = (epoch, perm[self.rank: self.per_rank * self.world: self.world])
        return self._epoch_cache[1]

    def next_indices(self) -> np.ndarray:
        epoch, b = divmod(self.consumed, self.batches_per_epoch)
        self.consumed += 1
        return self._shard(epoch)[b * self.micro: (b + 1) * self.micro]

    @property
    def epoch(self) -> int:
        return self.consumed // self.batches_per_epoch

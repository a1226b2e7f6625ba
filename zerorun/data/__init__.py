"""Training data. Launcher side: ``prepare`` (read, tokenize, pack, cache; bad data → DataError before
launch). Rank side: ``open_split`` and ``RankSampler`` (memory-mapped arrays, nothing written)."""
from ..config import DataError
from .builtin import BUILTIN, builtin_rows, sentiment_dataset, synthetic_corpus
from .loader import LabelledTexts, PackedBlocks, RankSampler, open_split, too_few_sequences
from .prepare import Prepared, builtin_name, cache_root, pack, prepare, save_ragged, tokenizer_spec
from .readers import read_labelled, read_lm_texts, read_rows

__all__ = [n for n in dir() if not n.startswith("_")]

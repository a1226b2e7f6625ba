"""Reading users' files (txt, jsonl, csv) and hub data sets; every error names the file and line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional, Tuple

from ..config import DataConfig, DataError, DataFormat

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
    fmt = DataFormat(fmt).value
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



def load_hub(data: DataConfig, task: str, num_labels: int):
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


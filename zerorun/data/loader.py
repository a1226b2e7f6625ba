"""Rank side: memory-mapped prepared splits and the per-rank sampler (no tokenizer, no files written)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ..config import DataError
from .prepare import Prepared


def too_few_sequences(n: int, global_batch: int, detail: str) -> Optional[DataError]:
    """One optimizer step needs a global batch of distinct sequences; checked by the launcher before
    anything starts and by the sampler on the rank."""
    if n >= global_batch:
        return None
    return DataError(f"{n} training sequences are too few for one global batch of {global_batch} ({detail}).",
                     "more data, a smaller data.seq_len or a smaller batch.", key="trainer.global_batch_size",
                     value=global_batch)


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

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

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



class RankSampler:
    """Shuffled, disjoint micro-batches per data-parallel rank, resumable from a count.

    Epoch e uses the permutation seeded by (seed, e). Optimizer step k takes the k-th run of
    global-batch indices (micro × ranks × accumulation) from it, and data-parallel rank r gets
    micro-batch j's slice j·ranks + r. So a step sees the same sequences whatever the split into
    ranks and micro-batches (data parallel or pipeline), and the state is just ``consumed``
    (micro-batches drawn by this rank): resume is exact.
    """

    GROUP = 64
    """With lengths: global batches per length-sorted group (HF's LengthGroupedSampler uses 50 megabatches)."""

    def __init__(self, n: int, rank: int, world: int, micro_batch: int, seed: int, accum: int = 1,
                 lengths: Optional[np.ndarray] = None):
        self.n, self.rank, self.world, self.micro, self.seed, self.accum = n, rank, world, micro_batch, seed, accum
        self.lengths = lengths
        self.global_batch = micro_batch * world * accum
        problem = too_few_sequences(n, self.global_batch,
                                    f"{world} ranks × micro-batch {micro_batch} × accumulation {accum}")
        if problem:
            raise problem
        self.steps_per_epoch = n // self.global_batch  # the remainder is dropped each epoch
        self.batches_per_epoch = self.steps_per_epoch * accum
        self.consumed = 0
        self._epoch_cache: Tuple[int, Optional[np.ndarray]] = (-1, None)

    def _perm(self, epoch: int) -> np.ndarray:
        if self._epoch_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            if self.lengths is not None:
                perm = self._grouped(perm, np.random.default_rng([self.seed, epoch, 1]))
            self._epoch_cache = (epoch, perm)
        return self._epoch_cache[1]

    def _grouped(self, perm: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Length grouping (padded batches waste less): the shuffled order is cut into groups of GROUP global
        batches, each sorted by length, cut into global batches again, and those put in a shuffled order. A
        function of (seed, epoch, lengths, global batch) only: the same on every rank, whatever the micro-batch
        split, so resume stays exact."""
        g = self.global_batch
        usable = (self.n // g) * g
        out = []
        for start in range(0, usable, g * self.GROUP):
            chunk = perm[start:min(start + g * self.GROUP, usable)]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            blocks = chunk.reshape(-1, g)
            out.append(blocks[rng.permutation(len(blocks))].reshape(-1))
        return np.concatenate(out + [perm[usable:]]) if out else perm

    def next_indices(self) -> np.ndarray:
        epoch, b = divmod(self.consumed, self.batches_per_epoch)
        self.consumed += 1
        step, j = divmod(b, self.accum)
        start = step * self.global_batch + (j * self.world + self.rank) * self.micro
        return self._perm(epoch)[start: start + self.micro]

    @property
    def epoch(self) -> int:
        return self.consumed // self.batches_per_epoch


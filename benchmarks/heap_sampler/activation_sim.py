"""The activation phases' large blocks replayed through a best-fit page heap: an instrument for what the page-heap
term (zerorun/memory/page_heap.py) assumes about the forward and backward, not yet a term of the estimate.

    python benchmarks/heap_sampler/activation_sim.py DIR/config.json --task sequence_classification \
        --batch 16 --seq 352 [--no-checkpointing] [--lora query_proj,value_proj --r 16] [--dtype fp32] [--steps 3]

The model transformers builds from the config.json runs forward, loss (zerorun's fused loss for a causal LM) and
backward on fake tensors, with checkpointing as zerorun's ranks run it (non-reentrant) and the parameters' gradients
dropped after each step. Every storage an op makes is an allocation and its release (weak reference) a free, in
the order the Python code makes them. The replay places blocks of 256 KiB and more (tcmalloc's page heap; smaller
ones go to its size classes) best fit in 8 KiB pages, lowest address on ties, coalescing neighbours on free and
growing the heap at its top where nothing fits (release rate 0: nothing returned). It prints the live peak and
the heap's top after each phase.

What it showed (2026-11-29; `bigalloc` logs of the real ranks, tcmalloc):
- DeBERTa-v2 (hidden 128, 8 heads, 3 layers), ZeRO-0, fp32, LoRA r 16 on query/value, SGD, checkpointing, micro
  16 x 352: live peak 415 MiB, heap top 459 MiB from the second step on (the recomputation's s² blocks find the
  spans the first backward left cut). The rank's heap rose 479 MiB from its first forward (177 -> 656 MiB, three
  growths by one 60.5 MiB s² block in the recomputations); the estimate counted 399 (-8.9% on the rank).
- tiny GPT-2 (2 x 128), ZeRO-1, fp32, checkpointing, micro 12 x 224: live peak 63.3, heap top 66.8 MiB; the real
  rank grew by eight 9.2 MiB score blocks, 36 MiB beyond the count. With ZeRO's own blocks between the layers'
  (gradient buckets, the flat partition, the step's blocks) the activations alone do not predict it: a term built
  on this needs DeepSpeed's allocations in the same sequence.
"""
from __future__ import annotations

import argparse
import json
import logging
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from zerorun.arch import trace_modes
from zerorun.arch import traced as T

PAGE = 8192
LARGE = 256 * 1024
"""tcmalloc's largest size class: larger blocks are spans of the page heap."""
MiB = 2**20


def allocation_events(config: dict, task: str, batch: int, seq: int, dtype: torch.dtype, checkpointing: bool,
                      steps: int, lora: Optional[Tuple[List[str], int]]):
    """[("alloc", key, bytes) | ("free", key)] of ``steps`` training steps, and [(phase, index into the events)]."""
    fields = T.clean_fields({k: v for k, v in config.items() if k not in ("model_type", "transformers_version")})
    model = T._meta_model(config["model_type"], fields, task, 2)
    if lora:
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # peft imports it; its 4-bit kernels are not used
        model = T.with_lora(model, task, (tuple(lora[0]), lora[1], 0.05))  # adapter.dropout's default
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    events: List[tuple] = []
    live: Dict[int, int] = {}

    class Record(TorchDispatchMode):
        def __init__(self, skip):
            super().__init__()
            self.skip = skip

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                st = t.untyped_storage() if isinstance(t, torch.Tensor) else None
                if st is None or st._cdata in self.skip or id(st) in live:
                    continue
                live[id(st)] = key = len(events)
                events.append(("alloc", key, st.nbytes()))
                weakref.finalize(st, lambda sid=id(st): events.append(("free", live.pop(sid))) if sid in live
                                 else None)
            return out

    marks: List[Tuple[str, int]] = []
    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        T._fake_copy(model, dtype).train()
        if task == "causal_lm":
            from zerorun.train import fused_loss

            fused_loss.install(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if lora:
                model.enable_input_require_grads()
        skip = frozenset(t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()])
        ids = torch.zeros((batch, seq), dtype=torch.long)
        kwargs = {"labels": ids} if task == "causal_lm" else {
            "attention_mask": torch.ones((batch, seq), dtype=torch.long), "labels": torch.zeros(batch, dtype=torch.long)}
        with trace_modes.balanced_mode(0), Record(skip):
            for _ in range(steps):
                marks.append(("forward", len(events)))
                loss = model(input_ids=ids, **kwargs).loss
                marks.append(("backward", len(events)))
                loss.backward()
                del loss
                for p in model.parameters():
                    p.grad = None
                marks.append(("step end", len(events)))
    return events, marks


class PageHeap:
    """Free spans by start page; best fit, lowest address on ties; frees coalesce; growth at the top."""

    def __init__(self):
        self.top, self.free, self.used = 0, {}, {}

    def alloc(self, key: int, nbytes: int) -> None:
        if nbytes < LARGE:
            return
        n = -(-nbytes // PAGE)
        fits = [(length, start) for start, length in self.free.items() if length >= n]
        if fits:
            length, start = min(fits)
            del self.free[start]
            if length > n:
                self.free[start + n] = length - n
        else:
            tail = next((s for s, length in self.free.items() if s + length == self.top), None)
            start = tail if tail is not None else self.top
            self.free.pop(start, None)
            self.top = start + n
        self.used[key] = (start, n)

    def release(self, key: int) -> None:
        if key not in self.used:
            return
        start, n = self.used.pop(key)
        left = next((s for s, length in self.free.items() if s + length == start), None)
        if left is not None:
            n += self.free.pop(left)
            start = left
        if start + n in self.free:
            n += self.free.pop(start + n)
        self.free[start] = n


def replay(events, marks):
    """[(phase, heap top bytes, live peak bytes so far)] after each phase mark."""
    heap, sizes, now, peak, out = PageHeap(), {}, 0, 0, []
    at: Dict[int, List[str]] = {}
    for name, i in marks:
        at.setdefault(i, []).append(name)
    for i, e in enumerate(events):
        out += [(name, heap.top * PAGE, peak) for name in at.get(i, [])]
        if e[0] == "alloc":
            heap.alloc(e[1], e[2])
            sizes[e[1]] = e[2]
            now += e[2]
            peak = max(peak, now)
        else:
            heap.release(e[1])
            now -= sizes.pop(e[1], 0)
    out.append(("end", heap.top * PAGE, peak))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--task", default="causal_lm")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--lora", default="", help="target modules, comma-separated")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    with open(a.config) as f:
        config = json.load(f)
    events, marks = allocation_events(config, a.task, a.batch, a.seq,
                                      torch.float32 if a.dtype == "fp32" else torch.bfloat16,
                                      not a.no_checkpointing, a.steps,
                                      (a.lora.split(","), a.r) if a.lora else None)
    print(f"{len(events):,} events; after each phase: heap top (blocks >= 256 KiB, best fit) and the live peak so far")
    for name, top, peak in replay(events, marks):
        print(f"  {name:9s} heap top {top / MiB:9.1f} MiB   live peak {peak / MiB:9.1f} MiB")


if __name__ == "__main__":
    main()

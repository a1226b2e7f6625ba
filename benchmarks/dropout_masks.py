"""CPU dropout masks: PyTorch's bernoulli_ kernel, zerorun's first form (uniform floats a chunk at a time) and its
kernel (16-bit lanes of 64-bit words), alone and inside a training step. Figures, not a test.

    OMP_NUM_THREADS=1 python benchmarks/dropout_masks.py [--steps 25] [--elements 2097152]

The step is the paired throughput benchmark's model (GPT-2 4 × 256, vocab 8,192, micro 8 × 256; forward and backward
with the model's own loss, no optimizer) on one thread; the kernels alternate step by step in this one process,
so a noisy machine slows all three alike. Medians over the steps after the first two rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from zerorun.train import dropout_masks

CHUNK = 1 << 16


def uniform_floats_(self, p: float = 0.5, *, generator=None):
    """zerorun's kernel until 2026-11-29: uniform floats a chunk at a time, compared with p."""
    flat = self.view(-1)
    with torch.no_grad():
        buf = torch.empty(min(CHUNK, flat.numel()))
        for start in range(0, flat.numel(), CHUNK):
            out = flat[start:start + CHUNK]
            torch.lt(buf[:out.numel()].uniform_(generator=generator), p, out=out)
    return self


KERNELS = {"pytorch": None, "uniform floats": uniform_floats_, "16-bit lanes": dropout_masks.fill_bernoulli_}


def use(name: str) -> None:
    dropout_masks.uninstall()
    if KERNELS[name] is not None:
        dropout_masks.fill_bernoulli_ = KERNELS[name]  # install() registers the module's attribute
        dropout_masks.install()


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--elements", type=int, default=2 * 2**20)
    a = ap.parse_args()
    torch.set_num_threads(1)
    mask = torch.empty(a.elements)
    print(f"one mask of {a.elements:,} fp32 elements, p = 0.9, one thread:")
    for name in KERNELS:
        use(name)
        print(f"  {name:15s} {median_ms(lambda: mask.bernoulli_(0.9), 30):7.2f} ms")

    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=256, n_embd=256, n_layer=4, n_head=4,
                                       n_inner=1024)).train()
    ids = torch.randint(0, 8192, (8, 256))
    steps = {name: [] for name in KERNELS}
    for _ in range(a.steps):
        for name in KERNELS:
            use(name)
            t = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            steps[name].append(time.perf_counter() - t)
    print(f"GPT-2 4 x 256, micro 8 x 256, forward + backward, {a.steps} steps each, alternating:")
    base = statistics.median(steps["uniform floats"][2:])
    for name, v in steps.items():
        med = statistics.median(v[2:])
        print(f"  {name:15s} {1e3 * med:7.1f} ms per step (min {1e3 * min(v):.1f}), {base / med:.3f}x uniform floats")


if __name__ == "__main__":
    main()

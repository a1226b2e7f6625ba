"""Dropout masks on CPU ranks drawn 16 bits at a time, a chunk at a time.

Every dropout on a CPU tensor (``nn.Dropout``, SDPA's math path with ``dropout_p``) draws its keep-mask with
``Tensor.bernoulli_(1 - p)``. PyTorch's CPU kernel for a scalar probability is serial whatever the thread count
and makes one generator call per element, through a per-element distribution object: 18.2 ms for 2 M elements
on one thread of an Intel Xeon (torch 2.13). Drawing ``uniform_`` floats a chunk at a time and comparing them with p
took 10.3 ms (zerorun's kernel until 2026-11-29); drawing 64-bit words (``random_`` over the full int64 range: one
``random64`` per word) and comparing each word's four 16-bit lanes with p·2^16 takes 3.6 ms, and a training step of
the paired benchmark's model 5% less time (benchmarks/dropout_masks.py; docs/speed.md §4).

The keep-probability is p rounded to the nearest 1/65536 (at most 7.6e-6 off; dropout's 1/(1-p) scale stays
PyTorch's). FlashAttention, the kernel SDPA picks for dropout on CUDA, rounds it to 8 bits (``floor(p · 255)``).

``install()`` registers it as the CPU kernel for ``aten::bernoulli_.float`` in the rank's process: drawn from the
same generator (seeded and checkpointed with the rest of the RNG state, so runs and resumes stay reproducible), a
different random stream from PyTorch's kernel. The word buffer bounds the transient memory at 128 KiB; the mask
itself is what the stock kernel writes (same tensor, same dtype). CUDA tensors keep CUDA's kernels: only the CPU
key is replaced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

CHUNK = 1 << 16
"""Mask elements per draw: 16,384 64-bit words (128 KiB, cache-sized), and few Python iterations (32 for 2 M)."""
LANES = 4
"""16-bit draws per 64-bit word."""
LEVELS = 1 << 16
"""Resolution of the keep-probability: a 16-bit lane is below round(p · 65536) with that probability / 65536."""

_library = None  # the torch.library registration; kept alive for the process's lifetime


def threshold(p: float) -> int:
    """The lanes (as signed int16, uniform on [-32768, 32767]) below this value are 1: round(p · 65536) of them."""
    return round(p * LEVELS) - LEVELS // 2


def fill_bernoulli_(self, p: float = 0.5, *, generator: Optional[torch.Generator] = None):
    """``self.bernoulli_(p)``: each element 1 with probability p (to 1/65536), else 0, ``CHUNK`` elements at a time."""
    import torch

    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    below = threshold(p)
    with torch.no_grad():
        if below <= -LEVELS // 2 or below >= LEVELS // 2:  # p rounds to 0 or 1: nothing to draw
            return self.fill_(float(below > 0))
        target = self if self.is_contiguous() else torch.empty_like(self, memory_format=torch.contiguous_format)
        flat = target.view(-1)
        words = torch.empty(-(-min(CHUNK, flat.numel()) // LANES), dtype=torch.int64)
        for start in range(0, flat.numel(), CHUNK):
            out = flat[start:start + CHUNK]
            # from int64's minimum to None: every 64-bit pattern equally likely (random_'s full-range kernel)
            drawn = words[:-(-out.numel() // LANES)].random_(-2**63, None, generator=generator)
            torch.lt(drawn.view(torch.int16)[:out.numel()], below, out=out)
        if target is not self:
            self.copy_(target)
    return self


def install() -> bool:
    """Use ``fill_bernoulli_`` for CPU tensors in this process (idempotent). False where torch has no
    ``torch.library`` registration for it (the stock kernel then stays)."""
    global _library
    if _library is not None:
        return True
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch says once that a kernel was overridden: that is the point
            warnings.simplefilter("ignore")
            lib = torch.library.Library("aten", "IMPL")
            lib.impl("bernoulli_.float", fill_bernoulli_, "CPU")
    except (AttributeError, RuntimeError):
        return False
    _library = lib
    return True


def uninstall() -> None:
    """PyTorch's own kernel again (tests; a process that installed it keeps it otherwise)."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None

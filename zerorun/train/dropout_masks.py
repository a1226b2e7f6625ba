"""Dropout masks on CPU ranks drawn from uniform numbers, a chunk at a time.

Every dropout on a CPU tensor (``nn.Dropout``, SDPA's math path with ``dropout_p``) draws its keep-mask with
``Tensor.bernoulli_(1 - p)``. PyTorch's CPU kernel for a scalar probability is serial whatever the thread count
and takes 1.9x as long as drawing uniform numbers and comparing them (torch 2.13, 2 M elements on one thread of
an Intel Xeon: 14.0 ms against 7.5 ms; on the AMD EPYC of earlier sessions ``F.dropout`` took 14.6 against 9.2 ms;
docs/speed.md §4). On GPT-2-class training with dropout 0.1 the stock masks took 7.6% of a CPU step.

``install()`` registers a CPU kernel for ``aten::bernoulli_.float`` in the rank's process that fills the mask
from ``uniform_`` numbers through a small fp32 buffer: the same Bernoulli(p) distribution from the same generator
(seeded and checkpointed with the rest of the RNG state, so runs and resumes stay reproducible), a different
random stream from PyTorch's kernel. The buffer bounds the transient memory at 256 KiB; the mask itself is what
the stock kernel writes (same tensor, same dtype). CUDA tensors keep CUDA's kernels: only the CPU key is replaced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

CHUNK = 1 << 16
"""Elements per uniform draw: 256 KiB of fp32, cache-sized, and few enough Python iterations (32 for 2 M)."""

_library = None  # the torch.library registration; kept alive for the process's lifetime


def fill_bernoulli_(self, p: float = 0.5, *, generator: Optional[torch.Generator] = None):
    """``self.bernoulli_(p)``: each element 1 with probability p, else 0, drawn ``CHUNK`` elements at a time."""
    import torch

    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")
    target = self if self.is_contiguous() else torch.empty_like(self, memory_format=torch.contiguous_format)
    flat = target.view(-1)
    with torch.no_grad():
        buf = torch.empty(min(CHUNK, flat.numel()), dtype=torch.float32)
        for start in range(0, flat.numel(), CHUNK):
            out = flat[start:start + CHUNK]
            draw = buf[:out.numel()].uniform_(generator=generator)  # [0, 1): P(draw < p) = p
            torch.lt(draw, p, out=out)
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

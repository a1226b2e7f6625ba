"""What CPU ranks let the math libraries keep: oneDNN's per-shape kernel caches are bounded
(launcher.KERNEL_CACHE_ENTRIES): a bf16 linear layer run forward and backward at 600 row counts (shapes_here), as
a mixture of experts' routing makes them, in a fresh process with the ranks' environment: its resident set stays
near the bound's worth of kernels, where PyTorch's defaults (1024 entries each) keep one kernel per shape (1,145
MiB here on AVX-512). And on tcmalloc MKL keeps no GEMM buffer beyond its call (launcher.mkl_fast_mm)."""
import json
import os
import subprocess
import sys

import pytest

from zerorun import allocators
from zerorun.config.schema import Allocator
from zerorun.launcher import KERNEL_CACHE_VARIABLES, rank_env

pytestmark = pytest.mark.integration

SHAPES = """
import json, torch
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
w = torch.randn(1024, 256, dtype=torch.bfloat16, requires_grad=True)
x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
torch.nn.functional.linear(x, w).sum().backward()  # the libraries paged in before the first figure
start = rss()
for rows in range(1, N + 1):
    x = torch.randn(rows, 256, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.linear(x, w).sum().backward()
print(json.dumps({"grew_mib": rss() - start}))
"""


def shapes_here() -> int:
    """600 row counts where oneDNN builds a bf16 kernel per shape (AVX-512); without it bf16 GEMMs run emulated, no
    kernel per shape and ~25x slower (600 took 6.5 min on an AMD EPYC with AVX2), so 120 show the same there."""
    import torch

    return 600 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 120


def grown_mib(env, shapes):
    script = SHAPES.replace("N + 1", str(shapes + 1))
    out = subprocess.run([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["grew_mib"]


def test_a_rank_keeps_a_bounded_number_of_shape_specific_kernels():
    # one thread in both: only the caches differ (two OpenMP threads spin-waiting beside other jobs on 2 cores
    # took this test from under a minute to 14)
    base = {**{k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_VARIABLES},
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    ranks = {**base, **rank_env("cpu", 1)}
    shapes = shapes_here()
    bounded, stock = grown_mib(ranks, shapes), grown_mib(base, shapes)
    # 128 entries in each cache at ~1 MiB per kernel of this shape, and what glibc's heap keeps of the kernels
    # built and dropped since (measured: 192 MiB against 1,145 stock; under tcmalloc 79 against 583).
    assert bounded < 300, f"grew {bounded:.0f} MiB over {shapes} shapes with the ranks' caches (stock: {stock:.0f})"
    if stock > 600:  # where this CPU builds a kernel per shape (AVX-512 bf16): the bound is what saves it
        assert bounded < stock / 3


GEMMS = """
import ctypes, json, torch
get = ctypes.CDLL(None).MallocExtension_GetNumericProperty  # tcmalloc's counters: the rank's preloaded malloc
get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
def allocated():
    v = ctypes.c_size_t(); get(b"generic.current_allocated_bytes", ctypes.byref(v)); return v.value
x = torch.randn(64, 64); x @ x
base = allocated()
for k, m in ((128, 384), (128, 512), (512, 128), (256, 1024)):  # tiny GPT-2's layers at micro 16 x 176
    a = torch.randn(2816, k, requires_grad=True); w = torch.randn(k, m, requires_grad=True)
    (a @ w).sum().backward(); del a, w
print(json.dumps({"kept_mib": (allocated() - base) / 2**20}))
"""


def kept_mib(env):
    out = subprocess.run([sys.executable, "-c", GEMMS], env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["kept_mib"]


def test_on_tcmalloc_mkl_frees_its_gemm_buffers_with_each_call():
    library = allocators.find_library(Allocator.tcmalloc)
    if not library:
        pytest.skip("tcmalloc is not installed (make system-deps)")
    base = {k: v for k, v in os.environ.items() if k not in (allocators.MKL_FAST_MM_OFF, "LD_PRELOAD")}
    ranks = {**base, **rank_env("cpu", 1, allocator="tcmalloc", allocator_library=library)}
    cached = {**base, **rank_env("cpu", 1, allocator="tcmalloc", allocator_library=library, mkl_fast_mm=True)}
    # measured: 0.01 MiB left allocated after the GEMMs against 20.2 with MKL's cache on a Xeon (its 4-6 MiB packing
    # buffers) and 3.3 on an AMD EPYC (MKL sizes them by the CPU it finds)
    left, kept = kept_mib(ranks), kept_mib(cached)
    assert left < 1, f"{left:.1f} MiB of GEMM buffers outlived their calls in the ranks' environment"
    if torch_uses_mkl():  # where MKL runs fp32 GEMMs, its cache is what the setting removes
        assert kept > left + 1, f"MKL's cache kept {kept:.1f} MiB, without it {left:.1f}"


def torch_uses_mkl() -> bool:
    import torch

    return torch.backends.mkl.is_available()

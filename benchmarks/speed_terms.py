"""Measure the step-time model's terms on this machine (zerorun/speed.py, ``CPU_RANK`` profile).

    python benchmarks/speed_terms.py [--threads 1] [--skip-collectives]

Each term with a plain micro-benchmark, nothing of zerorun's in the loop: dense matmul throughput per rank
(fp32, bf16) at the shapes a small transformer runs; gloo all-reduce latency and bandwidth between two
processes (a least-squares fit of time = latency + bytes / bandwidth); the optimizer steps per parameter
(torch AdamW, DeepSpeedCPUAdam, bitsandbytes' 8-bit AdamW); and the cost of first-touching freed memory
again (what a 1 MiB mmap threshold makes every step pay for its activations). Prints the figures that
zerorun/speed.py's CPU_RANK quotes. Figures, not a test.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time


def best_of(fn, repeat: int = 5) -> float:
    fn()
    return min(_timed(fn) for _ in range(repeat))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def matmul_flops(dtype) -> float:
    import torch

    a = torch.randn(2048, 256, dtype=dtype)
    b = torch.randn(256, 1024, dtype=dtype)
    n = 8
    secs = best_of(lambda: [a @ b for _ in range(n)])
    return n * 2 * 2048 * 256 * 1024 / secs


def optimizer_rates(numel: int = 4_000_000) -> dict:
    import torch

    out = {}
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4)
    out["torch_adamw"] = numel / best_of(opt.step)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam([p], lr=1e-4)
        out["cpu_adam"] = numel / best_of(opt.step)
    except Exception as e:  # noqa: BLE001 - the op may not be built here
        print(f"  DeepSpeedCPUAdam: not measured ({type(e).__name__}: {e})")
    try:
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit([p], lr=1e-4, min_8bit_size=4096)
        out["bnb_adamw8bit"] = numel / best_of(opt.step, repeat=3)
    except Exception as e:  # noqa: BLE001
        print(f"  bitsandbytes: not measured ({type(e).__name__}: {e})")
    opt = torch.optim.SGD([p], lr=1e-4, momentum=0.9)
    out["torch_sgd"] = numel / best_of(opt.step)
    return out


def first_touch_bytes_per_s(mib: int = 64) -> float:
    """Bytes/s of allocating, touching and freeing a buffer that glibc hands back to the OS each time."""
    import torch

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB: what launcher.mmap_threshold_mib=1 sets
    n = mib << 20
    fault = best_of(lambda: torch.empty(n, dtype=torch.uint8).fill_(1))
    keep = torch.empty(n, dtype=torch.uint8)
    warm = best_of(lambda: keep.fill_(1))  # the same writes with no page faults
    return n / max(1e-9, fault - warm)


def _allreduce_worker(rank: int, port: int, sizes, q) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    res = {}
    for n in sizes:
        t = torch.ones(n)
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(15):
            dist.barrier()
            s = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - s)
        res[n] = statistics.median(times)
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()


def allreduce_fit() -> tuple:
    import multiprocessing as mp
    import socket

    sizes = [256, 4096, 65536, 262144, 1048576, 4194304]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, sizes, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join()
    xs = [4 * n for n in sizes]
    ys = [res[n] for n in sizes]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    latency = max(1e-6, my - slope * mx)
    for n in sizes:
        print(f"  all_reduce {4 * n / 2**20:8.3f} MiB: {res[n] * 1e3:8.3f} ms")
    return latency, 1 / slope


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (zerorun gives 2 CPU ranks 1 each)")
    ap.add_argument("--skip-collectives", action="store_true")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    fp32, bf16 = matmul_flops(torch.float32), matmul_flops(torch.bfloat16)
    print(f"matmul 2048×256 @ 256×1024, {a.threads} thread(s): fp32 {fp32 / 1e9:.2f} GFLOP/s, "
          f"bf16 {bf16 / 1e9:.2f} GFLOP/s")
    rates = optimizer_rates()
    for k, v in rates.items():
        print(f"optimizer step {k}: {v / 1e6:.1f} M params/s")
    touch = first_touch_bytes_per_s()
    print(f"first touch of freed memory (mmap threshold 1 MiB): {touch / 2**30:.2f} GiB/s")
    if not a.skip_collectives:
        latency, bw = allreduce_fit()
        print(f"gloo all_reduce, 2 processes on loopback: latency {latency * 1e6:.0f} µs, "
              f"bandwidth {bw / 2**30:.2f} GiB/s (time = latency + bytes / bandwidth)")


if __name__ == "__main__":
    main()

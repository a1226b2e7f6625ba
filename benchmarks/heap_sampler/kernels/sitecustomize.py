"""16-bit GEMM kernels in a CPU rank (docs/memory.md §5.4, "16-bit kernels cut the freed spans"): an instrument, not
part of zerorun. oneDNN builds and caches a kernel per GEMM signature (shape, strides, dtype), ~0.6 MiB each.

    PYTHONPATH=benchmarks/heap_sampler/kernels GEMM_SIGNATURES_OUT=/tmp/sig zerorun ...   # record a run's signatures
    PYTHONPATH=benchmarks/heap_sampler/kernels GEMM_WARM_FROM=/tmp/sig/gemm-PID.txt zerorun ...  # build them first

Recording counts every 16-bit mm/addmm/bmm the rank's main thread dispatches (a line per signature: count, op,
((shape, stride), ...)), rewritten every second. Warming replays each recorded signature once on fresh tensors right
after ``deepspeed.initialize`` returns, before the first forward, so the kernels are built before any activation.
Only ranks with tcmalloc preloaded act (not the launcher)."""
import ast
import builtins
import os
import sys
import threading
import time

GEMMS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")


def _record(out_dir: str) -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = {}

    class Signatures(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in GEMMS:
                ts = [a for a in args if isinstance(a, torch.Tensor)]
                if ts and ts[0].dtype in (torch.bfloat16, torch.float16):
                    key = (str(func), tuple((tuple(t.shape), tuple(t.stride())) for t in ts), str(ts[0].dtype))
                    seen[key] = seen.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    Signatures().__enter__()

    def dump():
        while True:
            time.sleep(1.0)
            with open(f"{out_dir}/gemm-{os.getpid()}.txt", "w") as f:
                f.writelines(f"{n} {k!r}\n" for k, n in sorted(seen.items(), key=lambda kv: str(kv[0])))
    threading.Thread(target=dump, daemon=True).start()


def _warm(path: str) -> None:
    import torch

    ops = {name: getattr(torch.ops.aten, name.split(".")[1]).default for name in GEMMS}
    for line in open(path):
        name, specs, dtype = ast.literal_eval(line.split(" ", 1)[1].strip())
        ts = [torch.empty(1 + sum((s - 1) * st for s, st in zip(shape, stride)), dtype=getattr(torch, dtype[6:]))
              .normal_().as_strided(shape, stride) for shape, stride in specs]
        with torch.no_grad():
            out = ops[name](*ts)
        del out, ts


def _after_initialize(path: str) -> None:
    real_import = builtins.__import__

    def hook(name, *args, **kwargs):
        mod = real_import(name, *args, **kwargs)
        ds = sys.modules.get("deepspeed")
        if ds is not None and hasattr(ds, "initialize") and not getattr(ds.initialize, "_warms", False):
            initialize = ds.initialize

            def warmed(*a, **k):
                result = initialize(*a, **k)
                _warm(path)
                return result
            warmed._warms = True
            ds.initialize = warmed
            builtins.__import__ = real_import
        return mod
    builtins.__import__ = hook


if "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
    if os.environ.get("GEMM_SIGNATURES_OUT"):
        _record(os.environ["GEMM_SIGNATURES_OUT"])
    elif os.environ.get("GEMM_WARM_FROM"):
        _after_initialize(os.environ["GEMM_WARM_FROM"])

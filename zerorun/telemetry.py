"""What a rank measures about its own memory: peak RSS, the accelerator's peak, the model states
DeepSpeed holds, and (opt-in) the peak of live tensor bytes. Used by the rank (summary.json) and by the
validation benchmarks; torch is imported inside the functions.
"""
from __future__ import annotations

import resource
from typing import Dict, Optional

TRACK_MEMORY_ENV = "ZERORUN_TRACK_MEMORY"  # "1": count live tensor bytes on CPU ranks (summary.json)


def peak_rss_bytes() -> int:
    """This process's peak resident set size: what a cgroup limit and the OOM killer see. The kernel's VmHWM, not
    getrusage's ru_maxrss, which Linux carries across exec from the process that spawned this one: a calibration
    probe started by the gate (~450 MiB resident) read the gate's peak, not its own 398 MiB (process_probe.py)."""
    return rss_status()["VmHWM"]


def rss_status() -> Dict[str, int]:
    """The kernel's memory figures for this process in bytes (/proc/self/status): VmRSS (now), VmHWM (peak),
    RssAnon (heap and anonymous mappings), RssFile (mapped files: libraries, memory-mapped data), RssShmem."""
    out: Dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:  # not Linux: the peak from getrusage, nothing finer
        out = {}
    if "VmHWM" not in out:  # ru_maxrss is in KiB on Linux
        out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


class RssMilestones:
    """The process's peak RSS as a run passes named points: which part of a run raised the peak."""

    def __init__(self):
        self.points: Dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.points[name] = peak_rss_bytes()


def accelerator_peak_bytes() -> int:
    """torch.cuda.max_memory_allocated on a GPU rank; 0 elsewhere."""
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


def device_figures() -> Dict[str, int]:
    """On a GPU rank, what decides a CUDA OOM: the caching allocator's peak reserved memory, and the memory
    outside it (CUDA context, kernel images, NCCL buffers, library handles) = device used − reserved now, from the
    driver (``mem_get_info``). Their sum is the device peak the gate predicts. Empty on CPU ranks."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    free, total = torch.cuda.mem_get_info()
    outside = max(0, int(total - free) - int(torch.cuda.memory_reserved()))
    reserved = int(torch.cuda.max_memory_reserved())
    return {"allocated_peak": int(torch.cuda.max_memory_allocated()), "reserved_peak": reserved,
            "outside_allocator": outside, "device_peak": reserved + outside}


def _storages(tensors, device_type: Optional[str]) -> Dict[int, int]:
    """data_ptr → bytes of the distinct storages behind ``tensors``: scalars (Adam's step counters) left out,
    only those on ``device_type`` when given."""
    import torch

    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 1 and (device_type is None or t.device.type == device_type):
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def _tensors_in(obj, names):
    """Tensors held (in lists, tuples, dicts) by the attributes of ``obj`` called one of ``names``."""
    import torch

    found = []
    for name, v in vars(obj).items():
        if name not in names:
            continue
        stack = [v]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                found.append(x)
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
            elif isinstance(x, dict):
                stack.extend(x.values())
    return found


MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat",
                "fp32_groups_flat_partition", "fp32_groups")
"""DeepSpeed optimizer attributes holding the fp32 masters: ZeRO-1/2, ZeRO-3, FP16_Optimizer, BF16_Optimizer
(pipelines), FP16_UnfusedOptimizer. Exact names: BF16_Optimizer's gradient buffers share the prefix."""


def model_state_bytes(engine, device_type: Optional[str] = None) -> Dict[str, int]:
    """Bytes of model state a DeepSpeed engine holds on this rank, read from its own tensors, each storage
    once: the module's parameters (ZeRO-3: this rank's partition; its persistent small parameters whole,
    apart), the fp32 master copies and the optimizer's state tensors. Only those on ``device_type`` when
    given (on a GPU, offloaded states are host RAM). Gradients come and go within a step, so they are not here."""
    zopt = engine.optimizer
    base = getattr(zopt, "optimizer", zopt)
    params = list(engine.module.parameters())
    if params and hasattr(params[0], "ds_tensor"):
        pbytes = _storages([p.ds_tensor for p in params], device_type)
        # On one rank ZeRO-3 points a persistent parameter's data at the partition itself: count it once.
        persistent = {k: v for k, v in _storages([p.data for p in params if getattr(p, "ds_persist", False)],
                                                 device_type).items() if k not in pbytes}
    else:
        pbytes, persistent = _storages([p.data for p in params], device_type), {}
    owned = set(pbytes) | set(persistent)
    masters = [p for g in base.param_groups for p in g["params"]] + _tensors_in(zopt, MASTER_ATTRS)
    master = {k: v for k, v in _storages([t.data for t in masters], device_type).items() if k not in owned}
    states = _storages([t for st in base.state.values() for t in st.values()], device_type)
    return {"parameters": sum(pbytes.values()), "persistent parameters": sum(persistent.values()),
            "fp32 master copies": sum(master.values()), "optimizer states": sum(states.values())}


_LIVE_BYTES_CLS = None


_LIVE_BYTES_CLS = None


def live_bytes():
    """A new LiveBytes tracker: a TorchDispatchMode that counts the bytes of every storage an op returns
    (the first time it sees it) until that storage is freed, and the peak of that sum. Storages made
    before it starts count only once ``add``-ed. Like torch's MemTracker (docs/memory.md §8) without its
    per-module bookkeeping, which made the validation matrix three times slower."""
    global _LIVE_BYTES_CLS
    if _LIVE_BYTES_CLS is None:
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        from torch.utils.weak import WeakIdKeyDictionary

        class LiveBytes(TorchDispatchMode):
            def __init__(self, device_type: str = "cpu"):
                super().__init__()
                self.device_type = device_type
                self.sizes = WeakIdKeyDictionary()
                self.live = 0
                self.peak = 0

            def _free(self, box):
                self.live -= box[0]

            def add(self, t, count: bool = True) -> None:
                if t.device.type != self.device_type:  # meta tensors (DeepSpeed makes some) hold no memory
                    return
                st = t.untyped_storage()
                if st in self.sizes:
                    return
                box = [st.nbytes() if count else 0]
                self.sizes[st] = box
                weakref.finalize(st, self._free, box)
                self.live += box[0]
                self.peak = max(self.peak, self.live)

            def reset_peak(self) -> int:
                self.peak = self.live
                return self.live

            def __enter__(self):
                tracker, orig = self, torch.UntypedStorage.resize_
                self._orig_resize = orig

                def resize_(st, size):  # not a dispatched op: ZeRO-3 frees gathered params with it
                    orig(st, size)
                    box = tracker.sizes.get(st)
                    if box is not None and box[0] != st.nbytes():
                        tracker.live += st.nbytes() - box[0]
                        box[0] = st.nbytes()
                        tracker.peak = max(tracker.peak, tracker.live)

                torch.UntypedStorage.resize_ = resize_
                return super().__enter__()

            def __exit__(self, *exc):
                torch.UntypedStorage.resize_ = self._orig_resize
                return super().__exit__(*exc)

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        self.add(t)
                return out

        _LIVE_BYTES_CLS = LiveBytes
    return _LIVE_BYTES_CLS()

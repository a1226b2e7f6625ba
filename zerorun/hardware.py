"""What this machine has: accelerators and their memory, host RAM, free disk, libaio, writable
directories. The only module that looks at the machine; ``resolve_hardware`` merges declared
``hardware.*`` values over what it finds."""
from __future__ import annotations

import ctypes.util
import errno
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from .config import HardwareConfig

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """A node's resources, detected or declared (hardware.* keys) for planning elsewhere."""

    accelerator: str  # "cuda" or "cpu"
    gpus_per_node: int
    gpu_mem_bytes: int  # per GPU; 0 on CPU
    host_mem_bytes: int
    nodes: int = 1
    cpu_cores: int = 1
    fp16_ok: bool = True  # CPU ranks: DeepSpeed's CPU accelerator runs fp16 only with AVX512-FP16/AMX
    host_available_bytes: int = 0
    """Host RAM a job can still get: MemAvailable, capped by the cgroup's headroom (0: unknown, use
    host_mem_bytes). What the OOM killer or a cgroup limit will judge the ranks' resident memory against."""
    device_name: str = ""
    """The GPU (or CPU) model: calibrations are kept per device."""

    @property
    def host_usable_bytes(self) -> int:
        return self.host_available_bytes or self.host_mem_bytes

    def threads_per_rank(self, nproc_per_node: int) -> int:
        """OMP/MKL threads each of ``nproc_per_node`` ranks gets (launcher.rank_env): the cores shared out."""
        return max(1, self.cpu_cores // max(1, nproc_per_node))

    def describe(self) -> str:
        avail = (f" ({self.host_available_bytes / GIB:.1f} GiB available)"
                 if self.host_available_bytes and self.host_available_bytes < self.host_mem_bytes else "")
        if self.accelerator == "cpu":
            return (f"no GPU: CPU ranks on gloo (DS_ACCELERATOR=cpu), {self.cpu_cores} cores, "
                    f"{self.host_mem_bytes / GIB:.0f} GiB RAM{avail}")
        return (f"{self.nodes} node(s) × {self.gpus_per_node} GPU(s) of {self.gpu_mem_bytes / GIB:.3g} GiB, "
                f"{self.host_mem_bytes / GIB:.0f} GiB host RAM per node{avail}")


def _nvidia_smi_memory() -> Optional[List[int]]:
    """Total memory of each visible GPU in bytes, or None when nvidia-smi is not there."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    sizes = [int(float(x)) * 1024**2 for x in out.split() if x.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        sizes = sizes[: len([v for v in visible.split(",") if v.strip()])]
    return sizes


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The kernel's estimate of memory available to new work without swapping (MemAvailable); 0 if unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cgroup_headroom_bytes(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """How much more this process's memory cgroup may charge before its limit (v2 memory.max or v1
    memory.limit_in_bytes, the tightest along the path), minus what it holds that cannot be reclaimed;
    None without a limit."""
    try:
        lines = open(proc_cgroup).read().splitlines()
    except OSError:
        return None
    best: Optional[int] = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, limit_file, usage_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file = os.path.join(root, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(base, *parts[:depth])
            try:
                raw = open(os.path.join(d, limit_file)).read().strip()
                usage = int(open(os.path.join(d, usage_file)).read().strip())
            except (OSError, ValueError):
                continue
            if raw == "max" or int(raw) >= 1 << 60:  # no limit at this level
                continue
            reclaimable = _cgroup_stat(os.path.join(d, "memory.stat"), ("inactive_file", "total_inactive_file"))
            headroom = int(raw) - usage + reclaimable
            best = headroom if best is None else min(best, headroom)
    return best


def _cgroup_stat(path: str, keys) -> int:
    try:
        for line in open(path):
            k, _, v = line.partition(" ")
            if k in keys:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def host_available_bytes() -> int:
    """What the ranks can still get on this node: MemAvailable, capped by the cgroup's headroom."""
    avail = mem_available_bytes()
    headroom = cgroup_headroom_bytes()
    if headroom is not None:
        avail = min(avail, headroom) if avail else headroom
    return max(0, avail)


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def free_disk_bytes(path: str) -> int:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return shutil.disk_usage(p).free


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, as a cgroup or taskset limits it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def detect() -> Hardware:
    """This machine. DS_ACCELERATOR=cpu forces CPU ranks even where GPUs exist."""
    cores = cpu_cores()
    gpus: List[int] = []
    names: List[str] = []
    if os.environ.get("DS_ACCELERATOR", "") != "cpu":
        smi = _nvidia_smi_memory()
        if smi is None and _gpu_device_nodes():  # no nvidia-smi here: ask CUDA (imports torch)
            try:
                import torch

                if torch.cuda.is_available():
                    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
                    smi, names = [p.total_memory for p in props], [p.name for p in props]
            except Exception:  # a broken CUDA install should not stop CPU planning
                smi = None
        gpus = smi or []
    avail = host_available_bytes()
    if gpus:
        return Hardware("cuda", len(gpus), min(gpus), host_memory_bytes(), 1, cores, host_available_bytes=avail,
                        device_name=(names[0] if names else _nvidia_smi_name()) or "cuda")
    return Hardware("cpu", 0, 0, host_memory_bytes(), 1, cores, fp16_ok=_cpu_fp16_supported(),
                    host_available_bytes=avail, device_name=cpu_model())


def _nvidia_smi_name() -> str:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ""
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
        return out.splitlines()[0].strip() if out.strip() else ""
    except (subprocess.SubprocessError, OSError):
        return ""


GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/proc/driver/nvidia/gpus/*", "/dev/dxg", "/dev/nvhost-*", "/dev/kfd")
"""Where a GPU torch.cuda could use shows itself: NVIDIA (and MIG: its parent device), WSL2, Jetson, ROCm."""


def _gpu_device_nodes() -> bool:
    """Whether the kernel shows a GPU torch.cuda could use: without one, importing torch (~1 s of every launch)
    to ask CUDA finds nothing. DS_ACCELERATOR=cuda always asks."""
    import glob

    return os.environ.get("DS_ACCELERATOR") == "cuda" or any(glob.glob(p) for p in GPU_DEVICE_NODES)


def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> Optional[set]:
    """The x86 CPU's feature flags, or None (not x86, or unreadable)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def _cpu_fp16_supported() -> bool:
    """The same test DeepSpeed's CPU accelerator makes before it accepts fp16 (torch's mkldnn check: on x86,
    AVX512-FP16 or AMX-FP16), read from the CPU flags without importing torch where it can be."""
    flags = _cpu_flags()
    if flags is not None:
        return bool(flags & {"avx512_fp16", "amx_fp16"})
    try:
        import torch

        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


def libaio_available() -> bool:
    """NVMe offload needs libaio at run time (DeepSpeed's async_io op)."""
    return ctypes.util.find_library("aio") is not None


def writable_dir_problem(path: str) -> Optional[str]:
    """None when ``path`` is (or can be made) a directory this process can write files in; else why not.

    Found by trying: create the missing directories, write and delete a file, then remove the
    directories this made. Permission bits alone say nothing about /proc, read-only mounts or a
    path under a regular file. Tried again when the directory vanished under the write: the nodes of a job
    probe the same shared run directory at once, and one's clean-up can remove what the other just made.
    """
    for _ in range(10):
        why = _write_probe(os.path.abspath(path))
        if why is not _VANISHED:
            return why
        time.sleep(0.05)
    return os.strerror(errno.ENOENT)


_VANISHED = "vanished"
"""_write_probe's answer when the directory it had just made was gone before the write."""


def _write_probe(target: str) -> Optional[str]:
    created = []
    p = target
    while not os.path.exists(p):
        created.append(p)
        p = os.path.dirname(p)
    try:
        os.makedirs(target, exist_ok=True)
        probe = os.path.join(target, f".zerorun-probe-{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            f.write("x")
        os.remove(probe)
        return None
    except FileNotFoundError:  # made a moment ago, so something removed it: another node's probe
        return _VANISHED
    except OSError as e:
        return e.strerror or type(e).__name__
    finally:
        for d in created:  # deepest first
            try:
                os.rmdir(d)
            except OSError:
                pass


def resolve_hardware(declared: "HardwareConfig", detected: Optional[Hardware], *, host_mem_bytes: int = 0,
                     cpu_cores: int = 1) -> Hardware:
    """The machine to plan for: the declared ``hardware.*`` values over what ``detect()`` found.

    ``detected`` may be None when the GPU side is declared (see ``needs_detection``); host RAM and
    cores then come from the keyword arguments (host_memory_bytes() is cheap: no torch).
    Declaring GPU memory on a machine without GPUs plans for one GPU per node.
    """
    d = detected
    gpus = declared.gpus_per_node if declared.gpus_per_node is not None else (d.gpus_per_node if d else 0)
    mem = (int(declared.gpu_mem_gib * GIB) if declared.gpu_mem_gib is not None
           else (d.gpu_mem_bytes if d and d.accelerator == "cuda" else 0))
    if gpus == 0 and declared.gpus_per_node is None and declared.gpu_mem_gib is not None:
        gpus = 1
    declared_host = declared.host_mem_gib is not None
    host = int(declared.host_mem_gib * GIB) if declared_host else (d.host_mem_bytes if d else host_mem_bytes)
    nodes = declared.nodes if declared.nodes is not None else (d.nodes if d else 1)
    accel = "cuda" if gpus > 0 else "cpu"
    gpu_declared = declared.gpus_per_node is not None or declared.gpu_mem_gib is not None
    return Hardware(accelerator=accel, gpus_per_node=gpus, gpu_mem_bytes=mem if accel == "cuda" else 0,
                    host_mem_bytes=host, nodes=nodes, cpu_cores=d.cpu_cores if d else cpu_cores,
                    fp16_ok=True if accel == "cuda" else (d.fp16_ok if d else False),
                    # A declared size is a plan for another machine: nothing of it is in use yet.
                    host_available_bytes=0 if declared_host or not d else d.host_available_bytes,
                    device_name="" if gpu_declared or not d else d.device_name)


def needs_detection(declared: "HardwareConfig") -> bool:
    """Whether ``detect()`` must run (it may import torch): the GPU side is not fully declared.
    Host RAM alone never needs it (host_memory_bytes() reads sysconf)."""
    return not (declared.gpus_per_node == 0 or
                (declared.gpus_per_node is not None and declared.gpu_mem_gib is not None))

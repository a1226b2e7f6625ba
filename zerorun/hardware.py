"""What this machine has: accelerators and their memory, host RAM, free disk. The only module that looks."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import List, Optional

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

    def describe(self) -> str:
        if self.accelerator == "cpu":
            return f"no GPU: CPU ranks on gloo (DS_ACCELERATOR=cpu), {self.cpu_cores} cores, {self.host_mem_bytes / GIB:.0f} GiB RAM"
        return (f"{self.nodes} node(s) × {self.gpus_per_node} GPU(s) of {self.gpu_mem_bytes / GIB:.3g} GiB, "
                f"{self.host_mem_bytes / GIB:.0f} GiB host RAM per node")


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


def free_disk_bytes(path: str) -> int:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return shutil.disk_usage(p).free


def detect() -> Hardware:
    """This machine. DS_ACCELERATOR=cpu forces CPU ranks even where GPUs exist."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus: List[int] = []
    if os.environ.get("DS_ACCELERATOR", "") != "cpu":
        smi = _nvidia_smi_memory()
        if smi is None:
            try:
                import torch

                if torch.cuda.is_available():
                    smi = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
            except Exception:  # a broken CUDA install should not stop CPU planning
                smi = None
        gpus = smi or []
    if gpus:
        return Hardware("cuda", len(gpus), min(gpus), host_memory_bytes(), 1, cores)
    return Hardware("cpu", 0, 0, host_memory_bytes(), 1, cores, fp16_ok=_cpu_fp16_supported())


def _cpu_fp16_supported() -> bool:
    """The same test DeepSpeed's CPU accelerator makes before it accepts fp16."""
    try:
        import torch

        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False

"""LaunchPlan → (argv, env) for the deepspeed CLI or torchrun (pure), and run() (the side effect)."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .config.rules import CPU_MMAP_THRESHOLD, MMAP_OFF_BYTES

TRAIN_MODULE = "zerorun.train"
SHM_DIR = "/dev/shm"
@dataclass(frozen=True)
class LaunchPlan:
    launcher: str  # "deepspeed" | "torchrun"
    run_dir: str
    nproc_per_node: int
    accelerator: str  # "cuda" | "cpu"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    hostfile: str = ""
    threads_per_rank: int = 1
    mmap_threshold: int = CPU_MMAP_THRESHOLD
    expandable_segments: bool = True
    allocator: str = "glibc"  # allocators.Resolved's name: what the ranks run
    allocator_library: str = ""  # the library preloaded for it ('' for glibc or a user's own LD_PRELOAD)
    mkl_fast_mm: bool = False  # launcher.mkl_fast_mm
    bin_dir: str = ""  # where the venv's console scripts live; "" means PATH
    stop_timeout_s: int = 110  # torchrun: how long ranks may take to save after a stop signal
    rdzv: str = "static"  # torchrun: "static" | "c10d"
    rdzv_id: str = ""
    min_nnodes: int = 0  # c10d: elastic minimum (0: fixed at nnodes)
    rdzv_host: bool = False  # c10d: this node serves the rendezvous store (master_addr is one of its addresses)
    local_addr: str = ""  # c10d: this node's address as the others reach it


# torchrun handles only SIGTERM/INT/HUP/QUIT by default: SIGUSR1/2 (Slurm --signal, submitit) would kill it
# and orphan the ranks. Handled, it passes the signal to the ranks, which checkpoint and stop.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"


def _exe(plan: LaunchPlan, name: str) -> str:
    if plan.bin_dir:
        candidate = os.path.join(plan.bin_dir, name)
        if os.path.exists(candidate):
            return candidate
    return name


CUDA_ALLOC_CONF = "expandable_segments:True"
"""CUDA ranks: PyTorch's caching allocator grows segments in place instead of caching fixed blocks, the standard
fix for OOMs from fragmentation mid-run (reserved far above allocated). launcher.expandable_segments=false drops
it; a PYTORCH_CUDA_ALLOC_CONF the user set wins."""
KERNEL_CACHE_ENTRIES = 128
"""CPU ranks: entries in oneDNN's primitive cache and PyTorch's ideep LRU cache (1024 each by default). A 16-bit
matmul on CPU runs a oneDNN kernel built for its exact shape, and each cache keeps one per shape seen, at ~0.3-2
MiB apiece (bf16 linear, AVX-512: 32x16 to 1024x4096 weights). Fixed-shape training needs a few dozen; a mixture
of experts routes a different number of tokens to each expert every step, so at the defaults a tiny Qwen3-MoE rank
grew 590 -> 1,100 MiB over 8 steps (docs/memory.md §5.4). At 128: 592 MiB, the same tokens/s (7,910 against
7,748); at 64 the MoE ran 0.92x, re-building kernels it still needed."""
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def extensions_dir() -> str:
    """Where DeepSpeed's JIT ops (cpu_adam, async_io) are built and found: one directory per
    Python environment. torch's default, ~/.cache/torch_extensions, is keyed by op name only, so two venvs on
    one machine (other include paths) rebuild each other's ops, minutes each time. `make ops` (zerorun.prebuild)
    builds into it once; ranks, calibration probes and the memory harness all load from it. A
    TORCH_EXTENSIONS_DIR already set (docker/Dockerfile) wins. Not under $ZERORUN_CACHE (cachedir.py): the ops
    belong to the environment, not to a cache that tests and users point at fresh directories (minutes each)."""
    import hashlib

    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    return os.path.join(os.path.expanduser("~"), ".cache", "zerorun", "torch_extensions", key)


def rank_env(accelerator: str, threads_per_rank: int, mmap_threshold: int = CPU_MMAP_THRESHOLD,
             expandable_segments: bool = True, allocator: str = "glibc", allocator_library: str = "",
             mkl_fast_mm: bool = False) -> Dict[str, str]:
    """The environment every rank process starts with (also the calibration probes', so they measure the same).
    ``allocator``/``allocator_library``: allocators.resolve's choice (glibc's mmap settings apply to glibc only)."""
    from . import allocators
    from .config.schema import Allocator

    env = {
        "OMP_NUM_THREADS": str(threads_per_rank),
        "MKL_NUM_THREADS": str(threads_per_rank),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = extensions_dir()
    resolved = allocators.Resolved(Allocator(allocator), allocator_library,
                                   users_own=bool(os.environ.get("LD_PRELOAD")))
    env.update(allocators.env_for(resolved))
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env.update({k: str(KERNEL_CACHE_ENTRIES) for k in KERNEL_CACHE_VARIABLES if k not in os.environ})
        if resolved.name == Allocator.glibc:  # glibc's MALLOC_* variables mean nothing to a preloaded malloc
            env.update(glibc_env(mmap_threshold))
        env.update(allocators.mkl_env(resolved.name, mkl_fast_mm))
    elif expandable_segments and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        env["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF
    return env


def glibc_env(mmap_threshold: int) -> Dict[str, str]:
    """glibc malloc's settings for launcher.mmap_threshold_mib."""
    if mmap_threshold >= MMAP_OFF_BYTES:
        # No mappings, no trimming: freed blocks (the logits too) are reused, not page-faulted anew.
        return {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(MMAP_OFF_BYTES)}
    return {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)}  # a fixed value also stops its dynamic growth


def node_hostfile_path(run_dir: str, node_rank: int) -> str:
    return os.path.join(run_dir, f"hostfile.node{node_rank}")


def node_hostfile(nnodes: int, slots: int) -> str:
    """The world for ``deepspeed --no_ssh``: N nodes of ``slots`` ranks (names only order the nodes)."""
    return "".join(f"node{i} slots={slots}\n" for i in range(nnodes))


def build_command(plan: LaunchPlan) -> Tuple[List[str], Dict[str, str]]:
    """The argv and the environment additions that start every rank of the plan.

    Ranks get only the run dir: no Hydra argv, and ``--no_local_rank`` so DeepSpeed does not
    append ``--local_rank=N`` (ranks read LOCAL_RANK from the environment).
    """
    env = rank_env(plan.accelerator, plan.threads_per_rank, plan.mmap_threshold, plan.expandable_segments,
                   plan.allocator, plan.allocator_library, plan.mkl_fast_mm)
    if plan.launcher == "deepspeed":
        argv = [_exe(plan, "deepspeed")]
        if plan.hostfile:  # one launch for all nodes, over pdsh/ssh
            argv += ["--hostfile", plan.hostfile, "--num_nodes", str(plan.nnodes),
                     "--master_addr", plan.master_addr]
        elif plan.nnodes > 1:
            # Node by node, zerorun started on each (as with torchrun): DeepSpeed's --no_ssh still reads the
            # world from a hostfile, so zerorun writes one (node_hostfile) naming nodes, not hosts.
            argv += ["--hostfile", node_hostfile_path(plan.run_dir, plan.node_rank), "--no_ssh",
                     "--node_rank", str(plan.node_rank), "--num_nodes", str(plan.nnodes),
                     "--master_addr", plan.master_addr]
        argv += ["--num_gpus", str(plan.nproc_per_node), "--master_port", str(plan.master_port),
                 "--no_local_rank", "--module", TRAIN_MODULE, plan.run_dir]
        return argv, env
    if plan.launcher == "torchrun":
        argv = [_exe(plan, "torchrun"), "--nproc-per-node", str(plan.nproc_per_node)]
        if plan.nnodes > 1 and plan.rdzv == "c10d":
            # Any start order: torchrun assigns node ranks; the node at the endpoint hosts the store.
            nodes = f"{plan.min_nnodes}:{plan.nnodes}" if plan.min_nnodes else str(plan.nnodes)
            argv += ["--nnodes", nodes, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     f"{plan.master_addr}:{plan.master_port}", "--rdzv-id", plan.rdzv_id]
            # torchrun guesses the host by its hostname, wrong wherever the endpoint is not the hostname's
            # address (several interfaces, containers); zerorun knows it (netcheck.is_local).
            argv += ["--rdzv-conf", f"is_host={'true' if plan.rdzv_host else 'false'}"]
            if plan.local_addr:  # else torchrun advertises its hostname's address to the ranks of other nodes
                argv += ["--local-addr", plan.local_addr]
        elif plan.nnodes > 1:
            argv += ["--nnodes", str(plan.nnodes), "--node-rank", str(plan.node_rank),
                     "--master-addr", plan.master_addr, "--master-port", str(plan.master_port)]
        else:
            argv += ["--nnodes", "1", "--master-addr", plan.master_addr, "--master-port", str(plan.master_port)]
        argv += ["--signals-to-handle", TORCHRUN_SIGNALS, "--shutdown-timeout", str(plan.stop_timeout_s),
                 "-m", TRAIN_MODULE, plan.run_dir]
        return argv, env
    raise ValueError(f"unknown launcher {plan.launcher!r}")


def shell_line(argv: List[str], env: Dict[str, str]) -> str:
    """The command as one copy-pasteable shell line."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())] + [shlex.quote(a) for a in argv])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run(argv: List[str], env: Dict[str, str], finished: Optional[Callable[[], bool]] = None) -> int:
    """Start the launcher in its own process group and wait; Ctrl-C stops every rank. ``finished`` says that
    every rank has exited cleanly: the launcher has nothing left to do, so it is not waited for (returns 0)."""
    full_env = {**os.environ, **env}
    proc = subprocess.Popen(argv, env=full_env, start_new_session=True)
    try:
        while True:
            try:
                return proc.wait(timeout=0.1 if finished else None)
            except subprocess.TimeoutExpired:
                if finished is not None and finished():
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return 0
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def run_processes(run_dir: str) -> List[int]:
    """Live rank processes of a run (their command line names the run dir), however they were started."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        if TRAIN_MODULE.encode() in args and run_dir.encode() in args:
            found.append(int(proc.name))
    return found


def reap(run_dir: str, grace_s: float) -> int:
    """After the launcher exited: give the run's ranks ``grace_s`` to finish (a checkpoint being saved),
    then SIGKILL what is left (the deepspeed runner dies on SIGTERM and leaves its ranks running). Returns
    how many had to be killed."""
    import time

    deadline = time.monotonic() + grace_s
    while (left := run_processes(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(left)


def cpu_shm_name(master_addr: str, master_port: int | str, rank: int | str = "*", uid: Optional[int] = None) -> str:
    """The shared-memory segment DeepSpeed's CPU all-reduce makes per rank (ops/csrc/cpu/comm/shm.cpp
    shm_initialize: ``deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}``, ~66 MB). DeepSpeed never
    unlinks it, so each CPU run would leave ~66 MB of RAM per rank in /dev/shm until reboot. zerorun's ranks do not
    load the op (train.trainer.init_distributed); the supervisor still sweeps the name after a run."""
    uid = os.getuid() if uid is None else uid
    return f"deepspeed_allreduce_buffer_{uid}_{master_addr}_{master_port}_{rank}"


def release_cpu_shm(master_addr: str, master_port: int | str, rank: int | str = "*", shm_dir: str = SHM_DIR) -> int:
    """Unlink the all-reduce segments of the run on ``master_addr:master_port``: every rank's (the launcher,
    after the ranks have exited) or one rank's (that rank, after its last collective); returns the bytes freed."""
    freed = 0
    for path in Path(shm_dir).glob(cpu_shm_name(master_addr, master_port, rank)):
        try:
            size = path.stat().st_size
            path.unlink()
            freed += size
        except OSError:  # another process of the run removed it first
            pass
    return freed


def default_bin_dir() -> str:
    return str(Path(sys.executable).parent)

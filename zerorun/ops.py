"""DeepSpeed's JIT-compiled ops: which a run loads, whether they are built, and building them before ranks start.

DeepSpeed compiles an op the first time a process loads it (OpBuilder.jit_load → torch.utils.cpp_extension.load,
which builds TORCH_EXTENSIONS_DIR/<name>/<name>.so). Inside the ranks that is minutes of silence per op, in every
rank at once; so the launcher builds what the run will load first, with one line saying what and why
(`make demo` builds the demo's only; `make ops` and `make test` build all). ``needed`` is pure; ``built`` is a
few stat calls (it imports nothing), so a launch whose ops are built pays nothing.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Sequence, Tuple

from .config.errors import UserError
from .config.rules import OptimizerImpl, optimizer_impl
from .config.schema import OffloadDevice, RunConfig


@dataclass(frozen=True)
class Op:
    name: str
    """DeepSpeed's op name: the build folder and library under TORCH_EXTENSIONS_DIR (<name>/<name>.so)."""
    builder: str
    """The accelerator's builder class (get_accelerator().create_op_builder)."""
    package: str
    """deepspeed/ops/<package>/: where DeepSpeed keeps the op when it was built at install time (DS_BUILD_*=1)."""
    seconds: int
    """Its build on 2 cores without debug info (`python -m zerorun.prebuild` at commit 2d38601), for the
    progress line."""


OPS: Dict[str, Op] = {op.name: op for op in (
    Op("cpu_adam", "CPUAdamBuilder", "adam", 62),
    Op("async_io", "AsyncIOBuilder", "aio", 224),
)}


def needed(optimizer: OptimizerImpl, offload: OffloadDevice) -> Tuple[Tuple[str, str], ...]:
    """The JIT ops a rank loads, each with why: DeepSpeedCPUAdam steps offloaded optimizer states,
    NVMe offload swaps through async I/O. torch's AdamW (CPU ranks without offload), client optimizers and CUDA's
    NCCL load none; nor does a CPU rank's process group (train.trainer.init_distributed skips DeepSpeed's
    shared-memory all-reduce op, which training never calls)."""
    offload = OffloadDevice(offload)
    out = []
    if OptimizerImpl(optimizer) == OptimizerImpl.cpu_adam:
        out.append(("cpu_adam", f"offload={offload.value}"))
    if offload == OffloadDevice.nvme:
        out.append(("async_io", "offload=nvme"))
    return tuple(out)


def needed_for(cfg: RunConfig, accelerator: str) -> Tuple[Tuple[str, str], ...]:
    """``needed`` for a config on ranks of ``accelerator`` (the optimizer as make_plan picks it)."""
    offload = OffloadDevice(cfg.offload.device)
    offload_optimizer = cfg.zero.stage >= 1 and offload != OffloadDevice.none
    return needed(optimizer_impl(accelerator, offload_optimizer, cfg.optimizer.name), offload)


def extensions_dir_in_use(env: Mapping[str, str] = os.environ) -> str:
    """Where ranks started with ``env`` find their ops: its TORCH_EXTENSIONS_DIR, else zerorun's per-environment
    folder (launcher.rank_env sets that one for the ranks)."""
    from .launcher import extensions_dir

    return env.get("TORCH_EXTENSIONS_DIR") or extensions_dir()


DEBUG_FLAG = "-g"
"""What zerorun leaves out of DeepSpeed's host compiler flags: debug info for torch's headers is ~35% of each
translation unit's compile (async_io's twelve at -O0: 61 s → 39 s each on this machine's cores), and no one debugs
DeepSpeed's ops from a training run."""
_BUILDERS = ("CPUAdamBuilder", "AsyncIOBuilder", "PinMemoryBuilder")  # PinMemory: async_io's load builds it first


def without_debug_info() -> None:
    """Drop ``-g`` from the builders of the ops zerorun loads (class-level, once per process). torch rebuilds a
    JIT op whose flags changed, so every process that loads ops from zerorun's extensions folder calls this
    before the first load: the prebuild, and each rank as it starts (train.trainer.init_distributed)."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    for name in _BUILDERS:
        cls = accel.get_op_builder(name)
        if cls is None or getattr(cls.cxx_args, "zerorun", False):
            continue
        original = cls.cxx_args

        def cxx_args(self, _original=original):
            return [a for a in _original(self) if a != DEBUG_FLAG]

        cxx_args.zerorun = True
        cls.cxx_args = cxx_args


def _built_with_other_flags(ext_dir: str, name: str) -> bool:
    """A JIT build whose recorded host flags (torch writes them to the op's build.ninja) still carry ``-g``: an
    earlier zerorun's, or DeepSpeed's own default. The first rank to load it would recompile it, silently."""
    try:
        with open(os.path.join(ext_dir, name, "build.ninja")) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    return any(line.startswith("cflags =") and DEBUG_FLAG in line.split() for line in lines)


def built(name: str, ext_dir: str) -> bool:
    """Whether ``name`` loads without a compile: torch's JIT library in ``ext_dir`` made with zerorun's flags, or
    DeepSpeed's own build of it (an install with DS_BUILD_*=1, as docker/Dockerfile does). Stat calls and one small
    read: nothing is imported."""
    if os.path.isfile(os.path.join(ext_dir, name, name + ".so")):
        return not _built_with_other_flags(ext_dir, name)
    spec = importlib.util.find_spec("deepspeed")  # a top-level package: found, not imported
    roots = list(spec.submodule_search_locations or []) if spec else []
    return any(glob.glob(os.path.join(root, "ops", OPS[name].package, f"{name}_op*.so")) for root in roots)


def _about(seconds: int) -> str:
    return f"~{seconds} s" if seconds < 90 else f"~{round(seconds / 60)} min"


def ensure(ops: Sequence[Tuple[str, str]], accelerator: str, log: Callable[[str], None], ext_dir: str = "") -> None:
    """Build each op of ``ops`` that is not built yet in ``ext_dir`` (default: where the ranks will look), one
    line before and after each; a failed build is a UserError naming the op and its log (the ranks would only
    fail the same way)."""
    ext_dir = ext_dir or extensions_dir_in_use()
    for name, why in ops:
        if built(name, ext_dir):
            continue
        log(f"building DeepSpeed's {name} op for {why} (once per environment, {_about(OPS[name].seconds)} "
            f"on 2 cores) ...")
        os.makedirs(ext_dir, exist_ok=True)
        log_path = os.path.join(ext_dir, f"{name}.build.log")
        child = {**os.environ, "TORCH_EXTENSIONS_DIR": ext_dir}
        if accelerator == "cpu":
            child["DS_ACCELERATOR"] = "cpu"
        t0 = time.perf_counter()
        with open(log_path, "w") as out:
            rc = subprocess.run([sys.executable, "-m", "zerorun.prebuild", name], env=child, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        if rc != 0 or not built(name, ext_dir):
            lines = [ln for ln in open(log_path, errors="replace").read().splitlines() if ln.strip()]
            raise UserError(
                f"DeepSpeed's {name} op (needed for {why}) did not build: {lines[-1].strip() if lines else f'exit {rc}'}"
                f" (whole log: {log_path}).",
                "install a C++ compiler and Python's headers (apt-get install build-essential python3-dev"
                + (", libaio-dev" if name == "async_io" else "") + f"), then rerun; `python -m zerorun.prebuild "
                f"{name}` shows the build.", key="ops", value=name)
        log(f"{name} op built in {time.perf_counter() - t0:.0f} s ({ext_dir}).")

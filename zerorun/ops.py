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
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

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
    """Its build alone on 2 cores (`python -m zerorun.prebuild NAME` into an empty folder, async_io with its
    pin_memory and precompiled header, 2026-11-27), for the progress line."""
    accelerators: Tuple[str, ...] = ("cpu", "cuda")
    """Where zerorun's ranks load it: FusedAdam steps GPU ranks only (CPU ranks use torch's AdamW)."""
    measured_on: str = "2 cores"
    """Where ``seconds`` was measured, for the progress line."""


OPS: Dict[str, Op] = {op.name: op for op in (
    Op("cpu_adam", "CPUAdamBuilder", "adam", 62),
    Op("async_io", "AsyncIOBuilder", "aio", 196),
    # nvcc and the host compiler (two units): 33 s on the H100 machine, 35 s on the H200 one (2026-11-27).
    Op("fused_adam", "FusedAdamBuilder", "adam", 35, accelerators=("cuda",), measured_on="a 16-core GPU machine"),
)}


def needed(optimizer: OptimizerImpl, offload: OffloadDevice) -> Tuple[Tuple[str, str], ...]:
    """The JIT ops a rank loads, each with why: DeepSpeedCPUAdam steps offloaded optimizer states,
    NVMe offload swaps through async I/O, GPU ranks step DeepSpeed's FusedAdam (nvcc-built). torch's AdamW (CPU
    ranks without offload), client optimizers and CUDA's NCCL load none; nor does a CPU rank's process group
    (train.trainer.init_distributed skips DeepSpeed's shared-memory all-reduce op, which training never calls)."""
    offload = OffloadDevice(offload)
    out = []
    if OptimizerImpl(optimizer) == OptimizerImpl.cpu_adam:
        out.append(("cpu_adam", f"offload={offload.value}"))
    if OptimizerImpl(optimizer) == OptimizerImpl.fused_adam:
        out.append(("fused_adam", "the GPU ranks' Adam"))
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
PCH_HEADER = "torch/extension.h"
PCH_OPS = ("async_io",)
"""Ops whose translation units share one precompiled torch/extension.h: parsing it is ~40 of each of async_io's
twelve units' 42 s at -O0 (~16 s with the header precompiled, itself ~70 s once). cpu_adam's two units build in
parallel in about the header's own time, so it gains nothing."""
# PinMemory: async_io's load builds it first
_BUILDERS = ("CPUAdamBuilder", "AsyncIOBuilder", "PinMemoryBuilder", "FusedAdamBuilder")


def pch_dir(ext_dir: str, name: str) -> str:
    """Where the precompiled header for ``name`` lives while the prebuild compiles it (removed after: ~0.8 GB)."""
    return os.path.join(ext_dir, f"{name}.pch")


def _pch_flags(name: str) -> list:
    """``-include torch/extension.h`` first in every unit, found through a folder that holds the header's
    precompiled form beside a link to it. Without that folder (a rank compiling on its own) the same flags use
    torch's header: the same code, only slower, and the same flags, so nothing rebuilds."""
    return ["-I" + pch_dir(extensions_dir_in_use(), name), "-include", PCH_HEADER] if name in PCH_OPS else []


def deepspeed_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19's JIT builder parses it: each entry's arch-specific suffix dropped
    ("9.0a" → "9.0", "+PTX" kept). CUDA images for Hopper and Blackwell set such suffixes, and DeepSpeed's
    ``int("0a")`` then fails every op load, a built one's too (seen on an H100 image: "9.0a"). DeepSpeed's ops use
    no arch-specific instructions."""
    out = []
    for cc in value.replace(" ", ";").split(";"):
        cc = cc.strip()
        if cc:
            ptx = "+PTX" if cc.endswith("+PTX") else ""
            cc = ".".join(part.rstrip("abcdefghijklmnopqrstuvwxyz") for part in cc[:len(cc) - len(ptx)].split("."))
            if cc + ptx not in out:
                out.append(cc + ptx)
    return ";".join(out)


def set_build_flags() -> None:
    """The host compiler flags of the ops zerorun loads (class-level, once per process): no ``-g``, async_io's
    units on a precompiled header, and a TORCH_CUDA_ARCH_LIST DeepSpeed can parse; and torch's build lock with its
    owner written in (``owned_baton``). torch rebuilds a JIT op whose flags changed, so every process that loads
    ops from zerorun's extensions folder calls this before the first load: the prebuild, and each rank as it
    starts (train.trainer.init_distributed)."""
    import torch.utils.cpp_extension as ext
    from deepspeed.accelerator import get_accelerator

    if not getattr(ext.FileBaton, "zerorun", False):
        ext.FileBaton = owned_baton(lambda line: print(f"zerorun: {line}", file=sys.stderr, flush=True))

    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    accel = get_accelerator()
    for name in _BUILDERS:
        cls = accel.get_op_builder(name)
        if cls is None or getattr(cls.cxx_args, "zerorun", False):
            continue
        original = cls.cxx_args

        def cxx_args(self, _original=original):
            return [a for a in _original(self) if a != DEBUG_FLAG] + _pch_flags(self.name)

        cxx_args.zerorun = True
        cls.cxx_args = cxx_args


def _built_with_other_flags(ext_dir: str, name: str) -> bool:
    """A JIT build whose recorded host flags (torch writes them to the op's build.ninja) are not
    ``set_build_flags``'s: an earlier zerorun's, or DeepSpeed's own default. The first rank to load it would
    recompile it, silently."""
    try:
        with open(os.path.join(ext_dir, name, "build.ninja")) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    cflags = next((line.split()[2:] for line in lines if line.startswith("cflags =")), [])
    pch = _pch_flags(name)
    return DEBUG_FLAG in cflags or (bool(pch) and " ".join(pch[1:]) not in " ".join(cflags))


def _ninja_vars(build_dir: str) -> Dict[str, list]:
    """The compiler and flag variables torch wrote to ``build_dir``/build.ninja (torch joins flags with spaces and
    shell-quotes the compiler)."""
    with open(os.path.join(build_dir, "build.ninja")) as f:
        pairs = [line.rstrip("\n").partition(" = ") for line in f]
    return {k: shlex.split(v) for k, sep, v in pairs if sep and k in ("cxx", "cflags", "post_cflags")}


def precompile_header(build_dir: str, name: str, log: Callable[[str], None]) -> Optional[str]:
    """Compile torch/extension.h once with ``name``'s own flags (read from the build.ninja torch has just
    written, so they are exactly its units'), into ``pch_dir``, when ninja has units to compile. Returns the
    folder to remove once the op is built, or None. A header that does not precompile is logged and the units
    compile without it: GCC reads a precompiled header only when it matches, else the header itself."""
    if name not in PCH_OPS or shutil.which("ninja") is None:
        return None
    todo = subprocess.run(["ninja", "-C", build_dir, "-n"], capture_output=True, text=True)
    if todo.returncode != 0 or "no work to do" in todo.stdout:
        return None
    vars_ = _ninja_vars(build_dir)
    where = pch_dir(os.path.dirname(build_dir.rstrip(os.sep)), name)
    drop = {"-I" + where, "-include", PCH_HEADER}
    flags = [w for w in vars_.get("cflags", []) + vars_.get("post_cflags", []) if w not in drop]
    include_dirs = [f[len("-isystem"):] or flags[i + 1] for i, f in enumerate(flags) if f.startswith("-isystem")]
    header = next((os.path.join(d, PCH_HEADER) for d in include_dirs if os.path.isfile(os.path.join(d, PCH_HEADER))),
                  None)
    if header is None or not vars_.get("cxx"):
        return None
    link = os.path.join(where, PCH_HEADER)
    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(os.path.dirname(link))
    os.symlink(header, link)
    t0 = time.perf_counter()
    made = subprocess.run([*vars_["cxx"], *flags, "-x", "c++-header", link, "-o", link + ".gch"],
                          capture_output=True, text=True)
    if made.returncode != 0:
        log(f"{name}: {PCH_HEADER} did not precompile, its units parse it each ({made.stderr.strip()[-300:]})")
        shutil.rmtree(where, ignore_errors=True)
        return None
    log(f"{name}: {PCH_HEADER} precompiled in {time.perf_counter() - t0:.0f} s")
    return where


def _owner(path: str) -> str:
    """Who holds a build lock: '<pid> <start time>' written by ``OwnedBaton``, '' for torch's own (empty)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _me() -> str:
    import psutil

    return f"{os.getpid()} {psutil.Process().create_time():.2f}"


def stale(path: str) -> bool:
    """Whether a build lock's owner has died: its pid gone, or reused by a process that started at another time.
    A lock with no owner written (torch's own, or one just created) is never stale: it is waited on."""
    import psutil

    owner = _owner(path).split()
    if len(owner) != 2:
        return False
    try:
        return f"{psutil.Process(int(owner[0])).create_time():.2f}" != owner[1]
    except (psutil.NoSuchProcess, ValueError):
        return True


def owned_baton(log: Callable[[str], None]):
    """torch's JIT build lock (cpp_extension's FileBaton: a file created exclusively, removed when the build or
    load ends, waited on while it exists) with its owner written into it. A build stopped by Ctrl-C or a kill
    leaves the file behind, and every later load of that op (the prebuild's, each rank's) would wait on it
    forever, silently; a lock whose owner has died is removed, with one line, and the op built."""
    from torch.utils.file_baton import FileBaton

    class OwnedBaton(FileBaton):
        def try_acquire(self):
            while True:
                try:  # torch's exclusive create, open for writing the owner
                    self.fd = os.open(self.lock_file_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    if not self._took_over():
                        return False
                    continue
                os.write(self.fd, _me().encode())
                return True

        def wait(self):
            """Until the owner ends, or dies: then its op is not built, torch's import after this fails, and a
            rerun builds it (the lock is gone)."""
            t0, warned = time.monotonic(), False
            while os.path.exists(self.lock_file_path) and not self._took_over():
                time.sleep(self.wait_seconds)
                if not warned and time.monotonic() - t0 > 60:
                    warned = True
                    log(f"waiting on {self.lock_file_path}, held by {_owner(self.lock_file_path) or 'a torch build'}"
                        " for a minute: if no build of it is running, remove that file")

        def _took_over(self) -> bool:
            if not stale(self.lock_file_path):
                return False
            log(f"removed {self.lock_file_path}: its build (pid {_owner(self.lock_file_path).split()[0]}) "
                "stopped before it ended")
            try:
                os.remove(self.lock_file_path)
            except FileNotFoundError:
                pass
            return True

    OwnedBaton.zerorun = True
    return OwnedBaton


def build_with_precompiled_header(log: Callable[[str], None]) -> None:
    """Have torch's JIT build (this process's) precompile the header of a ``PCH_OPS`` op right before ninja
    compiles it, and remove it after. torch.utils.cpp_extension._run_ninja_build is the one step between
    writing build.ninja and compiling; where a torch lacks it, ops build as before."""
    import torch.utils.cpp_extension as ext

    run = getattr(ext, "_run_ninja_build", None)
    if run is None or getattr(run, "zerorun", False):
        return

    def run_ninja_build(build_directory, *args, **kwargs):
        where = precompile_header(build_directory, os.path.basename(build_directory.rstrip(os.sep)), log)
        try:
            return run(build_directory, *args, **kwargs)
        finally:
            if where:
                shutil.rmtree(where, ignore_errors=True)

    run_ninja_build.zerorun = True
    ext._run_ninja_build = run_ninja_build


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
            f"on {OPS[name].measured_on}) ...")
        os.makedirs(ext_dir, exist_ok=True)
        log_path = os.path.join(ext_dir, f"{name}.build.log")
        child = {**os.environ, "TORCH_EXTENSIONS_DIR": ext_dir}
        if accelerator == "cpu":
            child["DS_ACCELERATOR"] = "cpu"
        t0 = time.perf_counter()
        with open(log_path, "w") as out:
            rc = subprocess.run([sys.executable, "-m", "zerorun.prebuild", name], env=child, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        lines = [ln for ln in open(log_path, errors="replace").read().splitlines() if ln.strip()]
        for line in lines:  # a lock left by a stopped build, taken over (owned_baton): say so here too
            if line.startswith("zerorun: removed "):
                log(line[len("zerorun: "):])
        if rc != 0 or not built(name, ext_dir):
            raise UserError(
                f"DeepSpeed's {name} op (needed for {why}) did not build: {lines[-1].strip() if lines else f'exit {rc}'}"
                f" (whole log: {log_path}).",
                "install a C++ compiler and Python's headers (apt-get install build-essential python3-dev"
                + (", libaio-dev" if name == "async_io" else "")
                + ("; and CUDA's nvcc, of torch.version.cuda's major version" if name == "fused_adam" else "")
                + f"), then rerun; `python -m zerorun.prebuild {name}` shows the build.", key="ops", value=name)
        log(f"{name} op built in {time.perf_counter() - t0:.0f} s ({ext_dir}).")

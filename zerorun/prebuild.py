"""``python -m zerorun.prebuild [OP ...] [--for demo]``: compile DeepSpeed's JIT ops for this machine up front.

No argument: every op zerorun may load on this machine's accelerator (zerorun.ops.OPS: cpu_adam for optimizer
offload, async_io for NVMe offload, fused_adam on GPUs), side by side, as `make ops`/`make test` do; an op this
machine cannot build (async_io without libaio) is skipped. ``OP ...``: those only. ``--for demo``: the ones the
default job (`zerorun` with no arguments) loads on this machine, as `make demo` does (none: CPU ranks skip
DeepSpeed's shm comm op, train.trainer.init_distributed).
Otherwise zerorun's launcher builds what a run needs before its ranks start (zerorun.ops.ensure), and GPU images
build theirs at `docker build` time (docker/Dockerfile). Builds go where the ranks look (launcher.rank_env's
TORCH_EXTENSIONS_DIR), with zerorun's flags (zerorun.ops.set_build_flags: async_io on a precompiled header).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Sequence

from .ops import OPS, extensions_dir_in_use


def demo_ops() -> List[str]:
    """The ops the default job loads on this machine."""
    from .config import compose, plan_world
    from .hardware import detect
    from .ops import needed_for

    cfg = compose([])
    return [name for name, _ in needed_for(cfg, plan_world(cfg, detect()).accelerator)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zerorun.prebuild", description=__doc__.splitlines()[0])
    ap.add_argument("ops", nargs="*", metavar="OP", help=f"of {', '.join(OPS)} (default: all)")
    ap.add_argument("--for", dest="purpose", choices=["demo"], help="the ops the default job loads")
    args = ap.parse_args(argv)
    unknown = [n for n in args.ops if n not in OPS]
    if unknown:
        print(f"zerorun prebuild: error: unknown op {', '.join(unknown)}. Fix: name one of {', '.join(OPS)}.",
              file=sys.stderr)
        return 2
    names = args.ops or (demo_ops() if args.purpose == "demo" else list(OPS))
    strict = bool(args.ops)  # ops asked for by name must build; "all" skips what this machine cannot build
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir_in_use()  # where the ranks will look (launcher.rank_env)
    from deepspeed.accelerator import get_accelerator

    from .ops import build_with_precompiled_header, set_build_flags

    set_build_flags()  # the flags the ranks load with (else a rank would rebuild what this built)
    build_with_precompiled_header(lambda line: print(f"zerorun prebuild: {line}", file=sys.stderr))
    accel = get_accelerator()
    if not args.ops:  # "all": the ops this accelerator's ranks load (FusedAdam's CPU build is never loaded)
        names = [n for n in names if accel.device_name() in OPS[n].accelerators]
    buildable = []
    for name in names:
        builder = accel.create_op_builder(OPS[name].builder)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"zerorun prebuild: {name} cannot build on this machine ({accel.device_name()} accelerator)"
                  + ("" if strict else ", skipped"), file=sys.stderr)
            if strict:
                return 1
            continue
        buildable.append((name, builder))
    if len(buildable) > 1:
        return _in_parallel([name for name, _ in buildable])
    for name, builder in buildable:
        t0 = time.time()
        builder.load(verbose=False)
        print(f"zerorun prebuild: {name} ready ({time.time() - t0:.0f} s)", file=sys.stderr)
    if not names:
        print("zerorun prebuild: nothing to build", file=sys.stderr)
    return 0


def _in_parallel(names: Sequence[str]) -> int:
    """One process per op, at once. async_io's build is a chain (its pin_memory unit, then its precompiled
    header, each on one core, then its twelve units) that decides the total; the other ops build niced in the
    core the chain leaves free. On 2 cores: cpu_adam + async_io ~3.3 min, against ~4.5 one after the other."""
    import subprocess

    from .ops import PCH_OPS

    def start(name):
        nice = (lambda: os.nice(10)) if name not in PCH_OPS else None
        return subprocess.Popen([sys.executable, "-m", "zerorun.prebuild", name], preexec_fn=nice)

    return max(child.wait() for child in [start(name) for name in names])


if __name__ == "__main__":
    sys.exit(main())

"""``python -m zerorun.prebuild``: compile DeepSpeed's JIT ops for this machine once, up front.

Otherwise the first run that needs them (CPU offload: cpu_adam; NVMe offload: async_io; CPU ranks:
the shared-memory comm op) compiles them inside every rank's start-up, which takes minutes on a
small machine. GPU images build theirs at `docker build` time (docker/Dockerfile).
"""
from __future__ import annotations

import sys
import time

from .hardware import libaio_available


def main() -> int:
    import os

    from .launcher import extensions_dir

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())  # where the ranks will look (launcher.rank_env)
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    names = ["CPUAdamBuilder"]
    if accel.device_name() == "cpu":
        names.append("ShareMemCommBuilder")
    if libaio_available():
        names.append("AsyncIOBuilder")
    for name in names:
        builder = accel.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"zerorun prebuild: {name} not available on this machine, skipped", file=sys.stderr)
            continue
        t0 = time.time()
        builder.load(verbose=False)
        print(f"zerorun prebuild: {name} ready ({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

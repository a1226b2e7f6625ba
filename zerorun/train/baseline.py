"""A rank's process baseline, measured: the resident memory of a CPU rank with everything a rank imports
and its process group up, before any tensor (the "ready" point of a real rank, docs/memory.md §5.4).

It differs between machines by tens of MiB with the same software (shared libraries, the kernel's
accounting), which is 5-10% of a tiny model's peak: the gate measures it once per machine and software
(zerorun.calibration.ensure_baseline) instead of trusting a constant. Prints one JSON line.

    python -m zerorun.train.baseline FAMILY
"""
from __future__ import annotations

import json
import os
import socket
import sys


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m zerorun.train.baseline FAMILY", file=sys.stderr)
        return 2
    # What a rank imports before "ready" (train/trainer.py Trainer.__init__), in the same order.
    import deepspeed  # noqa: F401  (first, as in a rank)
    import torch.distributed as dist

    from ..models import import_model_code
    from ..telemetry import rss_status
    from . import trainer  # the rank's own modules: strategy, checkpoint, data

    with socket.socket() as s:  # a one-rank group on loopback, as a rank's group is up at "ready"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    trainer.init_distributed()
    import_model_code(args[0])
    status = rss_status()
    dist.destroy_process_group()
    print(json.dumps({"baseline_bytes": status.get("VmHWM", 0), "status": status}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

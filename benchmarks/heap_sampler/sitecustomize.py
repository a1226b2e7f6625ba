"""tcmalloc's own counters, sampled inside every rank of a run: where a rank's resident memory goes beyond its
live tensors (docs/memory.md §5.4). Not part of zerorun: an instrument for the page-heap term.

    PYTHONPATH=benchmarks/heap_sampler HEAP_SAMPLE_OUT=/tmp/heap zerorun +model=gpt2 ...
    python benchmarks/heap_sampler/timeline.py /tmp/heap/heap-PID.jsonl

Python imports ``sitecustomize`` at start-up from PYTHONPATH, which the launcher passes to its ranks; only a
process that runs with tcmalloc preloaded samples (the ranks, not the launcher). Each line: seconds since start,
VmRSS, and gperftools' ``MallocExtension_GetNumericProperty`` values (live bytes, heap size, free and unmapped
page-heap bytes, thread and central caches), every 20 ms.
"""
import ctypes
import json
import os
import threading
import time

PROPERTIES = ("generic.current_allocated_bytes", "generic.heap_size", "tcmalloc.pageheap_free_bytes",
              "tcmalloc.pageheap_unmapped_bytes", "tcmalloc.current_total_thread_cache_bytes",
              "tcmalloc.central_cache_free_bytes")


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _sample(out_dir: str, period: float = 0.02) -> None:
    get = ctypes.CDLL(None).MallocExtension_GetNumericProperty
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
    value = ctypes.c_size_t(0)
    t0 = time.time()
    with open(os.path.join(out_dir, f"heap-{os.getpid()}.jsonl"), "w") as out:
        while True:
            row = {"t": round(time.time() - t0, 3), "rss": _rss()}
            for name in PROPERTIES:
                get(name.encode(), ctypes.byref(value))
                row[name.split(".")[-1]] = value.value
            out.write(json.dumps(row) + "\n")
            out.flush()
            time.sleep(period)


if "tcmalloc" in os.environ.get("LD_PRELOAD", "") and os.environ.get("HEAP_SAMPLE_OUT"):
    threading.Thread(target=_sample, args=(os.environ["HEAP_SAMPLE_OUT"],), daemon=True).start()

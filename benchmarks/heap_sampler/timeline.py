"""Print a heap sampler file (sitecustomize.py) as a timeline in MiB: every change of the heap's size, and the
peaks, so the moments tcmalloc's heap grows stand out."""
import json
import sys

MIB = 2**20


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    last_heap = None
    for r in rows:
        if r["heap_size"] != last_heap:
            print(f"t {r['t']:8.2f}  rss {r['rss'] / MIB:7.0f}  live {r['current_allocated_bytes'] / MIB:7.0f}  "
                  f"heap {r['heap_size'] / MIB:7.0f}  free {r['pageheap_free_bytes'] / MIB:7.0f}  "
                  f"unmapped {r['pageheap_unmapped_bytes'] / MIB:7.0f}")
            last_heap = r["heap_size"]
    peak = max(rows, key=lambda r: r["current_allocated_bytes"])
    print(f"peak live {peak['current_allocated_bytes'] / MIB:.0f} MiB at t {peak['t']}; heap at the end "
          f"{rows[-1]['heap_size'] / MIB:.0f} MiB (unmapped {rows[-1]['pageheap_unmapped_bytes'] / MIB:.0f}); "
          f"peak RSS {max(r['rss'] for r in rows) / MIB:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1])

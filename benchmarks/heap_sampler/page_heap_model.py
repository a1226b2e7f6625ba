"""Candidate models of tcmalloc's page-heap term, scored on stored RSS rows without running anything.

    python benchmarks/heap_sampler/page_heap_model.py benchmarks/results/rss-random/seed-1795765402.jsonl ...

For every tcmalloc row it rebuilds today's estimate (as rss_validation.py --rescore does), removes the shipped
page-heap term (memory/page_heap.py) and scores alternatives: the 15% of the allocator peak it replaced, and
"flat": what the activation phases' peak plus the step's transients exceed the allocator peak by, with no
block-size test and no logits block (docs/memory.md §5.4), plus a fraction of the peak.
"""
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rss_validation as R  # noqa: E402
from zerorun.memory.page_heap import logits_spans_taken  # noqa: E402

PAGE = "page heap (preloaded allocator)"
ACTIVATION_PHASES = ("loss", "backward", "embedding grad")


def cases(files: List[str]) -> List[Dict]:
    import json

    from zerorun.calibration import calibration_for, ensure_baseline
    from zerorun.config import compose, make_plan, plan_world
    from zerorun.hardware import detect
    from zerorun.memory import estimate
    from zerorun.memory.priors import OVERHEADS

    hw, out = detect(), []
    for r in (json.loads(line) for f in files for line in open(f)):
        if r.get("measured") is None or r.get("allocator") != "tcmalloc":
            continue
        ovs = [*R.BASE[:-1], f"launcher.mmap_threshold_mib={r.get('mmap_mib') or 1}", *r["config"].split(),
               "launcher.allocator=tcmalloc"]
        if not any(o.startswith("launcher.nproc_per_node") for o in ovs):
            ovs.append("launcher.nproc_per_node=2")
        cfg = compose([o for o in ovs if not o.startswith("data.path")])
        ensure_baseline(cfg, hw)
        cal = dataclasses.replace(calibration_for(cfg, hw), corrections=())
        if r.get("by_point", {}).get("ready"):
            cal = dataclasses.replace(cal, cpu_process_bytes=r["by_point"]["ready"], process_measured=True)
        plan = make_plan(cfg, plan_world(cfg, hw))
        est = estimate(cfg, plan, hw, cal=cal)
        if est.stages:  # pipeline stages: one rank's phases are a stage's
            continue
        point, bound = R.rank_figures(est.to_json(), r["rank"])
        out.append(dict(measured=r["measured"], base=point - est.components.get(PAGE, 0), shipped=point,
                        phases={k: dict(v) for k, v in est.phases.items()}, stage=cfg.zero.stage,
                        offload=plan.offload_optimizer, config=r["config"], optimizer=cfg.optimizer.name.value,
                        pipeline=bool(plan.pipeline), alloc_peak=peak({"phases": est.phases}),
                        counted=sum(v for k, v in est.components.items() if k not in OVERHEADS),
                        bound=bound, widths=dict(est.bound_widths)))
    return out


def peak(c: Dict) -> int:
    return max(sum(v.values()) for k, v in c["phases"].items() if k != "export")


def flat(c: Dict, fraction: float, with_offload: bool = True) -> int:
    """The activation phases' peak plus the largest contiguous transient of a later phase, beyond the peak."""
    ph = {k: v for k, v in c["phases"].items() if k != "export"}
    peak = max(sum(v.values()) for v in ph.values())
    act = max((sum(ph[p].values()) for p in ACTIVATION_PHASES if p in ph), default=0)
    late = ph.get("all-reduce", {}).get("all-reduce flatten buffer", 0)
    if "optimizer step" in ph and (with_offload or not c["offload"]):
        late = max(late, ph["optimizer step"].get("optimizer-step transient", 0))
    return max(0, act + late - peak) + int(fraction * peak)


def logits_block(c: Dict) -> int:
    return c["phases"].get("loss", {}).get("logits + loss", 0) * 4 // 12


def lazy_state_blocks(c: Dict) -> List[int]:
    """The flat blocks ZeRO-1/2's optimizer creates at its first step (after the first loss): Adam's two states of
    the partition, SGD's momentum, AdamW8bit's two 1-byte states."""
    if c["stage"] not in (1, 2) or c["pipeline"]:
        return []
    states = sum(v for k, v in c["phases"].get("optimizer step", {}).items() if k.startswith("optimizer states"))
    n = {"adamw": 2, "adamw8bit": 2, "sgd": 1}.get(c["optimizer"], 2)
    return [states // n] * n if states else []


def spans_taken(c: Dict) -> int:
    """How many of the loss's freed fp32 logits spans the lazily created state blocks take (page_heap.py's rule)."""
    return logits_spans_taken(logits_block(c), lazy_state_blocks(c))


def loss_rule(c: Dict, extra: Callable[[int], int]) -> int:
    """The shipped term with its loss branch replaced: the loss phase and ``extra(spans taken)`` logits blocks."""
    ph = {k: v for k, v in c["phases"].items() if k != "export"}
    live = {k: sum(v.values()) for k, v in ph.items()}
    shipped = c["shipped"] - c["base"]
    block = logits_block(c)
    k = extra(spans_taken(c))
    at_loss_old = live.get("loss", 0) + block - c["alloc_peak"] if block else 0
    at_loss_new = live.get("loss", 0) + k * block - c["alloc_peak"] if block else 0
    if k >= 1:  # the loss branch only grows
        return max(shipped, at_loss_new, 0)
    other = 0 if shipped > 0 and shipped == max(0, at_loss_old) else shipped  # (approximate: the other branch unknown)
    return max(other, at_loss_new, 0)


def score(cs: List[Dict], term: Callable[[Dict], int]) -> str:
    errs = [(c["base"] + term(c) - c["measured"]) / c["measured"] for c in cs]
    under = [e for e in errs if e < 0]
    return (f"{len(errs)} ranks: median |error| {100 * statistics.median(abs(e) for e in errs):.1f}%, worst "
            f"{100 * max(abs(e) for e in errs):.1f}%, under on {len(under)} (largest {-100 * min(errs):.1f}%)")


def main(files: List[str]) -> None:
    cs = cases(files)
    print("shipped (page_heap.py)     ", score(cs, lambda c: c["shipped"] - c["base"]))
    print("15% of the peak (before)   ", score(cs, lambda c: int(0.15 * peak(c))))
    print("loss: max(1, spans taken)  ", score(cs, lambda c: loss_rule(c, lambda k: max(1, k))))  # shipped
    print("loss: 1 + spans taken      ", score(cs, lambda c: loss_rule(c, lambda k: 1 + k)))
    print("loss: spans taken          ", score(cs, lambda c: loss_rule(c, lambda k: k)))
    for c in cs:
        taken = spans_taken(c)
        if taken:
            print(f"   {taken} taken: {c['config'][:90]} measured {c['measured'] / 2**20:.0f} shipped "
                  f"{c['shipped'] / 2**20:.0f} max(1,k) {(c['base'] + loss_rule(c, lambda k: max(1, k))) / 2**20:.0f}")
    for fraction in (0.0, 0.03, 0.05):
        print(f"flat + {fraction:.2f} of the peak    ", score(cs, lambda c: flat(c, fraction)))
        print("  without offload's step   ", score(cs, lambda c: flat(c, fraction, with_offload=False)))


if __name__ == "__main__":
    main(sys.argv[1:])

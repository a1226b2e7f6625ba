"""``zerorun-estimate``: the per-rank memory of every ZeRO stage × offload choice for one config.

    zerorun-estimate +model=gpt2-xl hardware.gpus_per_node=8 hardware.gpu_mem_gib=40

Takes the same Hydra overrides as ``zerorun`` (composed the same way, nothing launched, no run dir)
and prints, for the chosen micro-batch, sequence length and precision: per-GPU (or per-rank) peak,
host RAM per node, NVMe per node and whether it fits. ``hardware.*`` values that are not given are
detected on this machine (zerorun.hardware.detect); declared ones win.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List, Optional

from .hardware import GIB
from .train import heap_limit

EXIT_OK, EXIT_BAD_INPUT = 0, 2
USAGE = __doc__.split("\n\n")[1].strip() + "\n    --plot=FILE.png draws the rows as stacked bars (capacity as a line)"


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def render_table(cfg, plan, hw, rows, chosen_label: Optional[str]) -> List[str]:
    """The table lines (pure: estimates in, text out)."""
    from .config import Dtype
    from .memory import DEFAULT_CALIBRATION as cal

    m, tr, world = cfg.model, cfg.trainer, plan.world
    unit = "GPU" if hw.accelerator == "cuda" else "rank"
    first = rows[0][1]
    lines: List[str] = [
        f"{m.name} ({rows[0][1].summary['task']}): {rows[0][1].params:,} parameters · "
        f"{Dtype(cfg.precision.dtype).value} · micro-batch "
        f"{tr.micro_batch_size} × seq {cfg.data.seq_len} · activation checkpointing "
        f"{'on' if tr.activation_checkpointing else 'off'}{' · fused loss' if plan.fused_loss else ''} · "
        f"{world.size} rank(s) = {world.nnodes} node(s) × "
        f"{world.nproc_per_node} · global batch {plan.global_batch_size} "
        f"(accumulation {plan.grad_accum_steps})",
        f"hardware: {hw.describe()}",
        f"attention: {first.summary['attention_kernel']} (HF's default sdpa on {hw.accelerator})",
        "",
        f"  {'ZeRO / offload':32s} {'per-' + unit + ' peak':>14s} {'at most':>9s}  {'peak phase':14s} {'fits ' + unit:>9s}  "
        f"{'host RAM/node':>13s} {'fits host':>9s}  {'NVMe/node':>10s}  {'adamw8bit peak':>14s}  {'pred. s/step':>12s}",
    ]
    host_known = hw.host_mem_bytes > 0
    for label, e, e8, *step in rows:
        pred = f"{step[0].seconds:.3g}" if step and step[0] is not None else "-"
        mark = "*" if label == chosen_label else " "
        nvme = _gib(e.nvme_bytes) if e.nvme_bytes else "-"
        fits_host = ("yes" if e.fits_host else "NO") if host_known else "?"
        eight = (_gib(e8.per_rank_peak_bytes) + ("" if e8.fits else " NO")) if e8 else "-"
        lines.append(f"{mark} {label:32s} {_gib(e.per_rank_peak_bytes):>14s} {_gib(e.bound_bytes):>9s}  {e.peak_phase:14s} "
                     f"{'yes' if e.fits_device else 'NO':>9s}  {_gib(e.host_bytes_per_node):>13s} {fits_host:>9s}  "
                     f"{nvme:>10s}  {eight:>14s}  {pred:>12s}")
    chosen = next((row[1] for row in rows if row[0] == chosen_label), None)
    if chosen is not None and chosen.stages:
        lines.append(f"pipeline stages of the composed config ({len(chosen.stages)}; the peak above is the worst):")
        for st in chosen.stages:
            lines.append(f"  stage {st['stage']}: {st['blocks']} block(s) of {m.num_layers}"
                         f"{' + embeddings' if st['stage'] == 0 else ''}"
                         f"{' + head' if st['stage'] == len(chosen.stages) - 1 else ''}, {st['params']:,} parameters, "
                         f"{st['in_flight_micro_batches']} micro-batch(es) in flight: "
                         f"{_gib(st['per_rank_peak_bytes'])} ({st['peak_phase']})")
    cap = _gib(first.device_capacity_bytes)
    if hw.accelerator == "cuda":
        from .memory.estimate import allocator_margin

        lines.append(f"capacity {cap} per GPU. Peak = {1 + allocator_margin(cfg, cal):.2f} × allocator peak + CUDA context "
                     f"{_gib(cal.cuda_context_bytes)}" + (f" + NCCL {_gib(cal.nccl_bytes)}" if world.size > 1 else "") +
                     " (uncalibrated priors, docs/memory.md §5.2).")
    else:
        from .memory.priors import runtime_overhead_key

        measured = cal.runtime_overhead(runtime_overhead_key(cfg, hw, world.nproc_per_node))
        lines.append(f"capacity {cap} per rank = available host RAM / {world.nproc_per_node} ranks; CPU ranks keep "
                     f"everything in host RAM; the peak is their resident set: {_gib(cal.cpu_process_bytes)} process "
                     f"+ tensors + heap retention + runtime overhead ("
                     + (f"{_gib(measured)} for the composed config, measured here" if measured is not None else
                        f"{_gib(cal.cpu_overhead_bytes)}, +{_gib(cal.cpu_zero_overhead_bytes)} at ZeRO >= 1: priors")
                     + "; docs/memory.md §5.4).")
    lines.append("host RAM/node: the larger of the fp32 model every rank builds before DeepSpeed takes it and the "
                 "offloaded state, + the rank processes. * = the composed config. at most: the bound the gate decides on "
                 "(each term's uncertainty, docs/memory.md §5.6; fits = the bound fits"
                 + ("; CPU ranks on tcmalloc hold their heap under their capacity, never below this, while they run:"
                    " launcher.heap_limit_mib, §5.7"
                    if cfg.launcher.heap_limit_mib == -1
                    and heap_limit.applies(-1, hw.accelerator, cfg.launcher.allocator) else "")
                 + "). adamw8bit peak: the same row with "
                 "optimizer=adamw8bit (8-bit states, ~2 instead of 8 bytes per parameter; not with NVMe offload). pred. s/step: "
                 f"the step-time model autofit ranks by ({'measured on a CPU machine' if hw.accelerator == 'cpu' else 'GPU priors'}"
                 "; zerorun/speed.py).")
    if any(label.endswith(" ¹") for label, *_ in rows):
        lines.append("¹ the model's own loss: trainer.fused_loss runs at ZeRO-0/1/2 (ZeRO-3 keeps the head's weight "
                     "partitioned outside its forward).")
    if cfg.hardware.host_mem_gib is None and cfg.hardware.gpus_per_node:
        lines.append(f"host RAM {_gib(hw.host_mem_bytes)} per node is this machine's; declare hardware.host_mem_gib "
                     "to plan for another.")
    return lines


def _eight_bit(M, cfg, world, hw):
    """The estimate of ``cfg`` with adamw8bit, where DeepSpeed can run it (None: NVMe offload, pipelines, TP)."""
    import dataclasses

    from .config import OffloadDevice, OptimizerName, ParallelMode, make_plan

    if OffloadDevice(cfg.offload.device) == OffloadDevice.nvme or cfg.parallel.mode != ParallelMode.dp:
        return None  # (client optimizers with AutoTP: not run)
    c8 = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, name=OptimizerName.adamw8bit))
    return M.estimate(c8, make_plan(c8, world), hw)


def state_line(cfg, est) -> str:
    """The composed config's model states per rank: what a full fine-tune and an adapter differ in."""
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    names = ("parameters", "gradients", "fp32 master copies", "optimizer states")
    where = {k: sum(v for c, v in {**est.components, **est.host_components}.items() if c.startswith(k))
             for k in names}
    trainable = est.summary.get("trainable_params", est.params)
    base = ", the base in 4-bit NF4" if cfg.adapter.name.value == "qlora" else ""
    what = (f"adapter={cfg.adapter.name.value} (r={cfg.adapter.r}{base}): {trainable:,} of {est.params:,} parameters train "
            f"({100 * trainable / max(1, est.params):.2f}%)" if cfg.adapter.name.adapts
            else f"full fine-tune: all {est.params:,} parameters train")
    return f"model states per rank, composed config ({what}): " + ", ".join(f"{k} {gib(v)}" for k, v in where.items())


def adapter_line(M, cfg, world, hw) -> str:
    """What the adapter lever buys at the composed layout: full fine-tune, LoRA and QLoRA side by side (adapters at
    ZeRO-2 where the layout is ZeRO-3; QLoRA only where bitsandbytes is installed)."""
    import dataclasses
    import importlib.util

    from .config import AdapterName, check, make_plan

    out = []
    for name in (AdapterName.none, AdapterName.lora, AdapterName.qlora):
        if name == AdapterName.qlora and importlib.util.find_spec("bitsandbytes") is None:
            out.append("QLoRA: pip install 'zerorun[8bit]'")
            continue
        c = dataclasses.replace(cfg, adapter=dataclasses.replace(cfg.adapter, name=name, merge=False))
        if name.adapts and c.zero.stage == 3:
            c = dataclasses.replace(c, zero=dataclasses.replace(c.zero, stage=2),
                                    offload=dataclasses.replace(c.offload, params=False))
        if check(c, world, libaio=True, writable=lambda path: None):
            continue
        e = M.estimate(c, make_plan(c, world), hw)
        label = {"none": "full", "lora": "LoRA", "qlora": "QLoRA"}[name.value]
        short = "" if e.fits else (", does not fit" if not e.fits_device else ", host RAM short")
        out.append(f"{label} {_gib(e.per_rank_peak_bytes)} (at most {_gib(e.bound_bytes)}{short})")
    unit = "GPU" if hw.accelerator == "cuda" else "rank"
    where = "the composed layout" + (", adapters at ZeRO-2" if cfg.zero.stage == 3 else "")
    return f"by adapter ({where}), per {unit}: " + "; ".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plot = next((a.split("=", 1)[1] for a in argv if a.startswith("--plot=")), None)
    argv = [a for a in argv if not a.startswith("--plot=")]
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        print("Overrides as for zerorun: +model=NAME zero=stageN offload=cpu|nvme precision=fp32|fp16|bf16 "
              "trainer.micro_batch_size=N data.seq_len=N trainer.activation_checkpointing=true "
              "hardware.gpus_per_node=N hardware.gpu_mem_gib=G hardware.nodes=N hardware.host_mem_gib=G")
        return EXIT_OK
    from . import memory as M
    from .allocators import with_allocator
    from .config import ConfigError, GateMode, UserError, check, compose, make_plan, plan_world
    from .hardware import cpu_cores, detect, host_memory_bytes, needs_detection, resolve_hardware

    t0 = time.perf_counter()
    try:
        cfg = compose(argv, cached=True)  # the same typo check, composition and typing as zerorun (kept on disk)
        t1 = time.perf_counter()
        detected = detect() if needs_detection(cfg.hardware) else None
        t2 = time.perf_counter()
        hw = resolve_hardware(cfg.hardware, detected, host_mem_bytes=host_memory_bytes(), cpu_cores=cpu_cores())
        world = plan_world(cfg, hw)
        cfg, _ = with_allocator(cfg, world.accelerator)  # what CPU ranks would run here (zerorun resolves it alike)
        # zerorun's checks, minus its looks at this machine's disk: a plan may be for another cluster.
        problems = check(cfg, world, libaio=True, writable=lambda path: None)
        if problems:
            raise ConfigError(problems)
    except UserError as e:
        for p in (e.problems if isinstance(e, ConfigError) else [e]):
            print(f"zerorun-estimate: error: {p}", file=sys.stderr)
        return EXIT_BAD_INPUT
    plan = make_plan(cfg, world)
    table = M.table_configs(cfg, world.accelerator) + M.tp_table_configs(cfg, world)
    from .speed import predict_step_time

    plans = [make_plan(c, world) for _, c in table]
    rows = [(label, M.estimate(c, p, hw), _eight_bit(M, c, world, hw), predict_step_time(c, p))
            for (label, c), p in zip(table, plans)]
    chosen = next((label for (label, c), p in zip(table, plans) if (c.zero.stage, c.offload.device, p.offload_params,
                   p.tensor_parallel) == (cfg.zero.stage, cfg.offload.device, plan.offload_params,
                                          plan.tensor_parallel)), None)
    decision = M.gate(cfg, plan, hw, GateMode.strict)
    t3 = time.perf_counter()
    for line in render_table(cfg, plan, hw, rows, chosen):
        print(line)
    print(state_line(cfg, M.estimate(cfg, plan, hw)))
    print(adapter_line(M, cfg, world, hw))
    if plot:
        from .report import draw_estimate_table

        unit = "GPU" if hw.accelerator == "cuda" else "rank"
        path = draw_estimate_table([(row[0], row[1]) for row in rows], Path(plot),
                                   f"{cfg.model.name}: per-{unit} peak by ZeRO stage × offload (capacity in red)")
        print(f"picture: {path}")
    if not decision.ok and decision.suggestion:
        print(f"the composed config does not fit; the fastest that does: {' '.join(decision.suggestion)}")
    elif not decision.ok:
        print(f"the composed config does not fit: {decision.message}")
    sys.stdout.flush()
    hw_time = f"detected in {1000 * (t2 - t1):.0f} ms" if detected else "declared"
    print(f"(compose {1000 * (t1 - t0):.0f} ms, hardware {hw_time}, "
          f"{len(rows)} estimates + gate {1000 * (t3 - t2):.1f} ms)", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

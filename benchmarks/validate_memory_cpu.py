"""CPU validation of zerorun.memory: the estimate next to what real tensors hold (not a test).

    DS_ACCELERATOR=cpu python benchmarks/validate_memory_cpu.py [--quick]

One process, one thread, tiny models (tiny-gpt2 and tiny-bert from conf/model/), so it can run
next to other jobs. What it measures, and how (memory.md §6):

A. Activations saved for backward: a ``torch.autograd.graph.saved_tensors_hooks`` pack hook sees every
   tensor autograd keeps; unique storages, parameters and buffers excluded. The LM loss's saved
   log_softmax output is reported apart ("logits saved", expected 4·b·s·V of the 12 in §2.6). Under
   activation checkpointing the checkpoint keeps its inputs outside the hooks, so the end-of-forward
   figure is the live activation bytes that torch's MemTracker reports instead.
B. The forward/backward peak: MemTracker (live storages through a second, accumulating micro-step, so
   gradients are alive as the estimate assumes) minus parameters and buffers, against the estimate's
   largest forward/backward phase minus the same.
C. Model states of a real single-rank DeepSpeed engine (gloo, world 1, the ds_config zerorun renders,
   torch AdamW as on CPU ranks) for ZeRO-0..3 × fp32/bf16, read from the engine's tensors after one step.

What CPU cannot show (§6.4): CUDA kernels (flash/mem-efficient SDPA: CPU falls back to its math path
when dropout > 0, which the estimate models separately), 1-byte CUDA dropout masks, the CUDA context,
NCCL and allocator fragmentation, partitioning over more than one rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerorun import memory as M  # noqa: E402
from zerorun.config import Dtype, Family, ModelConfig, RunConfig  # noqa: E402
from zerorun.memory_measure import (CPU1, TINY_MODELS, batch, engine_model_states,  # noqa: E402
                                    init_single_rank, make_model, model_file, run_cfg, saved_activations,
                                    storages, tensors_in, tracked_step)
from zerorun.memory_measure import CPU_HW as HW  # noqa: E402
from zerorun.models import build_model  # noqa: E402

# The measurement helpers live in zerorun/memory_measure.py, shared with tests/unit/test_memory_validation.py
# (which runs the whole ZeRO × offload × dtype × checkpointing × seq matrix on real engines and asserts the
# accuracy targets) and benchmarks/validate_memory_gpu.py.


def tiny_models():
    """tiny-gpt2 (causal LM) and tiny-bert (2-way sequence classification) from conf/model/."""
    return [model_file(n) for n in TINY_MODELS]


def pct(est: float, meas: float) -> str:
    if meas == 0:
        return "  +0.0%" if est == 0 else "    n/a"
    return f"{100 * (est - meas) / meas:+6.1f}%"


def mib(n: float) -> str:
    return f"{n / 2**20:9.3f}"


# ---------------------------------------------------------------------------------------------- A, B


def logit_cells(est: float, meas: float, m: ModelConfig) -> str:
    if m.family != Family.gpt2:  # a b×num_labels classifier loss: no LM head
        return f"{'-':>9s} {'-':>10s} {'':>7s}"
    return f"{mib(est)} {mib(meas):>10s} {pct(est, meas)}"


def part_ab(models, dtypes, ckpts, seqs, micro, header=True):
    if header:
        print("A/B. activations and the forward/backward peak (single process, CPU, ZeRO-0 world 1)")
        print("     estimate for CPU ranks: sdpa-math attention (dropout 0.1), dropout masks in the compute dtype")
    hdr = (f"{'model':13s} {'dtype':5s} {'ckpt':4s} {'seq':>4s} | {'act est':>9s} {'act meas':>9s} {'err':>7s} |"
           f" {'logit est':>9s} {'logit meas':>10s} {'err':>7s} | {'peak est':>9s} {'peak meas':>9s} {'err':>7s} |"
           f" {'layer est':>9s} {'layer meas':>10s} {'err':>7s}   (MiB)")
    print(hdr)
    print("-" * len(hdr))
    errors = []
    for m in models:
        for dtype in dtypes:
            for ckpt in ckpts:
                for seq in seqs:
                    cfg = run_cfg(m, dtype, ckpt, seq, micro)
                    act = M.activations(m, micro, seq, dtype, "cpu", ckpt)
                    model = make_model(m, dtype, ckpt)
                    inputs = batch(m, micro, seq)
                    acts, logits, loss = saved_activations(model, inputs)
                    del loss
                    end_fwd, peak, layer_peak = tracked_step(model, inputs)
                    logit_est = 4 * micro * (seq * m.vocab_size if m.family == Family.gpt2 else 2)
                    if ckpt:
                        acts = end_fwd - logits  # checkpoint inputs are invisible to the pack hook
                    est = M.estimate(cfg, CPU1, HW)
                    fb = [ph for name, ph in est.phases.items() if name in ("loss", "backward", "embedding grad")]
                    states = ("parameters", "buffers", "fp32 master copies", "optimizer states")
                    peak_est = max(sum(v for k, v in ph.items() if k not in states) for ph in fb)
                    layer_est = sum(v for k, v in est.phases["backward"].items() if k not in states)
                    errors.append(abs(act.saved - acts) / acts)
                    print(f"{m.name:13s} {dtype.value:5s} {'on' if ckpt else 'off':4s} {seq:4d} | {mib(act.saved)} "
                          f"{mib(acts)} {pct(act.saved, acts)} | {logit_cells(logit_est, logits, m)} | "
                          f"{mib(peak_est)} {mib(peak)} {pct(peak_est, peak)} | {mib(layer_est)} "
                          f"{mib(layer_peak):>10s} {pct(layer_est, layer_peak)}")
                    del model
                    gc.collect()
    print(f"     activations: max |error| {100 * max(errors):.2f}% over {len(errors)} cases")
    if not header:
        print()
        return
    print("     act: saved for backward at the end of forward (with checkpointing: live bytes, which also hold the")
    print("          checkpoints' saved RNG states, 5 KiB per layer on CPU, not in the estimate)")
    print("     logit: the fp32 log_softmax output the loss saves (4 of the 12 bytes per logit at the loss peak)")
    print("     peak: gradients + activations + loss/embedding transients at the fwd/bwd peak (params excluded)")
    print("     layer: the same while the last layer runs backward (the estimate's 'backward' phase)")
    print()


# ---------------------------------------------------------------------------------------------- C


def engine_states(cfg: RunConfig, m: ModelConfig):
    """Two micro-steps of a real single-rank DeepSpeed engine; model-state bytes read from its tensors,
    and the optimizer step's transient (MemTracker peak of the tensors the 2nd step allocates)."""
    import deepspeed
    from torch.distributed._tools.mem_tracker import MemTracker
    from zerorun.ds_config import render

    ds = render(cfg, CPU1)
    torch.manual_seed(0)
    model = build_model(m, M.default_task(m), 2)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    inputs = batch(m, cfg.trainer.micro_batch_size, cfg.data.seq_len)
    zopt = engine.optimizer
    base = getattr(zopt, "optimizer", zopt)
    params = list(engine.module.parameters())
    for step in range(2):
        engine.backward(engine(**inputs).loss)
        if step == 1:  # gradients after backward, before the step: p.grad + the ZeRO partition buffers
            grads = [p.grad for p in params if p.grad is not None]
            grads += tensors_in(zopt, ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer"))
            gbytes = storages(grads)
            del grads  # holding them here would keep the grads DeepSpeed frees during the step alive
            # Register every tensor alive now, so the tracker's peak growth is what the step allocates.
            mt = MemTracker()
            mt.track_external(*[o for o in gc.get_objects() if isinstance(o, torch.Tensor)])
            with mt:
                before = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
                engine.step()
            step_peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - before
        else:
            engine.step()
    out = dict(engine_model_states(engine), gradients=sum(gbytes.values()))
    out["optimizer-step transient"] = step_peak
    del engine, model, zopt, base, params
    gc.collect()
    return out


def part_c(models, dtypes, stages, micro, seq):
    init_single_rank()
    print("C. model states of a real DeepSpeed engine, 1 rank on CPU (torch AdamW), after one step (MiB)")
    hdr = f"{'model':10s} {'dtype':5s} {'zero':4s} | " + " | ".join(
        f"{k:>22s}" for k in ("parameters", "gradients", "fp32 master", "optimizer states", "step transient"))
    print(hdr + "     each: estimate / measured  error")
    print("-" * len(hdr))
    for m in models:
        for dtype in dtypes:
            for stage in stages:
                cfg = run_cfg(m, dtype, False, seq, micro, stage)
                est = M.estimate(cfg, CPU1, HW)
                ph = est.phases["optimizer step"]
                meas = engine_states(cfg, m)
                cells = []
                for key in ("parameters", "gradients", "fp32 master copies", "optimizer states",
                            "optimizer-step transient"):
                    e = ph.get(key, 0) + (ph.get("persistent parameters", 0) if key == "parameters" else 0)
                    cells.append(f"{e / 2**20:7.3f}/{meas[key] / 2**20:7.3f} {pct(e, meas[key]):>7s}")
                print(f"{m.name:10s} {dtype.value:5s} {stage:4d} | " + " | ".join(cells))
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seq length, skip the DeepSpeed part")
    ap.add_argument("--only-deepspeed", action="store_true", help="only part C")
    ap.add_argument("--micro", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)  # stay out of the way of other jobs on this machine
    warnings.filterwarnings("ignore")  # deprecation chatter from torch.distributed and the module hooks
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    models = tiny_models()
    dtypes = [Dtype.fp32, Dtype.bf16]
    seqs = [64] if args.quick else [64, 256]
    print(f"torch {torch.__version__}, micro-batch {args.micro}; models: "
          + ", ".join(f"{m.name} (L{m.num_layers} h{m.hidden_size} a{m.num_heads} V{m.vocab_size}, "
                      f"{M.count_params(m):,} params)" for m in models))
    print()
    if not args.only_deepspeed:
        part_ab(models, dtypes, [False, True], seqs, args.micro)
        print("A'. the same with dropout 0: CPU SDPA then runs its flash kernel, the estimate's sdpa-fused count")
        print("    (what CUDA runs, minus CUDA's 1-byte dropout masks)")
        nodrop = [dataclasses.replace(m, name=m.name + "-p0", dropout=0.0) for m in models]
        part_ab(nodrop, dtypes, [False, True], seqs[-1:], args.micro, header=False)
    if not args.quick:
        part_c(models, dtypes, [0, 1, 2, 3], args.micro, 64)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

"""Pipeline vs data-parallel parity: one tiny model, the same data and optimizer, trained as a DeepSpeed
pipeline (zerorun.pipeline) and as the plain Hugging Face model; prints both loss trajectories and
the largest weight difference after training (not a test; run by hand).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --no_local_rank benchmarks/pipeline_parity.py --stages 2
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --no_local_rank benchmarks/pipeline_parity.py --family bert --stages 2
    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 --no_local_rank benchmarks/pipeline_parity.py --stages 2   # 2 replicas x 2 stages

What it does
------------
Every rank builds the same tiny model (seeded; dropout 0 so training is deterministic) and the pipeline
over it. Step s feeds pipeline replica d the micro-batches (s, d, 0..accum-1), generated from
(seed, step, replica, micro) alone, so any rank layout sees the same global batch. The pipeline
trains with ``engine.train_batch``; then every rank joins ``gather_hf_state_dict`` and global rank 0,
holding a copy of the model taken before training, replays the same steps on it in one process:
for each of the dp × accum micro-batches ``(loss / (dp·accum)).backward()``, then one optimizer step.
That is what data-parallel DeepSpeed (ZeRO 0-2, no clipping) computes, so in fp32 both trajectories
agree to float rounding (~1e-6); bf16 (``--dtype bf16``) shows the size of the 16-bit drift instead.
Gradient clipping is off on both sides (DeepSpeed 0.19 clips at 1.0 unless told otherwise).

Comparing zerorun runs (once the trainer wires parallel=pipeline)
------------------------------------------------------------------
Run the same experiment twice with dropout 0 and a fixed seed, e.g.

    zerorun +model=tiny-gpt2 model.dropout=0 parallel=dp trainer.max_steps=50 gate=off
    zerorun +model=tiny-gpt2 model.dropout=0 parallel=pipeline parallel.stages=2 trainer.max_steps=50 gate=off

and compare the ``loss`` column of the two ``metrics.jsonl`` files step by step. They match only if
(1) every pipeline replica draws the micro-batches its data-parallel rank would (the sampler must use
the *data-parallel* rank and size — ``engine.grid.data_parallel_id`` / ``engine.dp_world_size`` —
not the global ones: the first and last stage of a replica read the same sequences), (2) the global
batch is the same (pipeline: micro × gradient_accumulation_steps × dp replicas), (3) clipping, LR
schedule and weight decay are the same, and (4) the loss is averaged the same way (train_batch
returns the mean over the step's micro-batches and replicas). With dropout > 0 the trajectories
differ by noise only; compare their smoothed curves and final validation loss instead.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=["gpt2", "bert"], default="gpt2")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step per replica (gradient accumulation)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--partition", choices=["parameters", "uniform"], default="uniform")
    p.add_argument("--ckpt-interval", type=int, default=1, help="activation checkpoint interval (0: off)")
    p.add_argument("--zero", type=int, choices=[0, 1], default=0, help="ZeRO stage (pipelines allow 0 and 1)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="", help="write the JSON summary here (rank 0)")
    return p.parse_args(argv)


def tiny_model(family: str, seed: int):
    import torch

    from zerorun.config import Family, ModelConfig, TaskName
    from zerorun.models import build_model

    m = ModelConfig(name=f"tiny-{family}", family=Family(family), num_layers=4, hidden_size=64, num_heads=4,
                    intermediate_size=256, vocab_size=256, max_positions=64, dropout=0.0)
    task = TaskName.causal_lm if family == "gpt2" else TaskName.sequence_classification
    torch.manual_seed(seed)
    return build_model(m, task, num_labels=2), task


def micro_batch(args, step: int, replica: int, micro: int):
    """((inputs...), labels) for one micro-batch, from its coordinates alone."""
    import torch

    g = torch.Generator().manual_seed(((args.seed * 1009 + step) * 1009 + replica) * 1009 + micro)
    b, t = args.micro_batch, args.seq_len
    if args.family == "gpt2":
        ids = torch.randint(0, 256, (b, t), generator=g)
        return (ids,), ids
    width = int(torch.randint(t // 2, t + 1, (1,), generator=g))  # padded per batch, as LabelledTexts
    ids = torch.randint(1, 256, (b, width), generator=g)
    mask = torch.ones(b, width, dtype=torch.long)
    for row in range(b):
        n = int(torch.randint(width // 2, width + 1, (1,), generator=g))
        mask[row, n:] = 0
    ids[mask == 0] = 0
    labels = torch.randint(0, 2, (b,), generator=g)
    return (ids, mask), labels


def main(argv=None) -> int:
    args = parse_args(argv)
    import deepspeed
    import torch
    import torch.distributed as dist

    from zerorun.pipeline import build_pipeline_module, gather_hf_state_dict

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.stages:
        raise SystemExit(f"--stages {args.stages} must divide the {world} ranks")
    dp = world // args.stages

    model, task = tiny_model(args.family, args.seed)
    reference = copy.deepcopy(model) if rank == 0 else None
    pipe = build_pipeline_module(model, task, num_stages=args.stages, partition_method=args.partition,
                                 activation_checkpoint_interval=args.ckpt_interval)
    optimizer = torch.optim.AdamW([p for p in pipe.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.accum,
        "train_batch_size": args.micro_batch * args.accum * dp,
        "zero_optimization": {"stage": args.zero},
        "gradient_clipping": 0.0,
        "steps_per_print": 10 ** 9,
        "bf16": {"enabled": args.dtype == "bf16"},
    }
    engine, _, _, _ = deepspeed.initialize(model=pipe, optimizer=optimizer, config=ds_config)
    replica = engine.grid.data_parallel_id

    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        batches = iter([micro_batch(args, step, replica, k) for k in range(args.accum)])
        losses.append(engine.train_batch(batches).item())
    seconds = time.perf_counter() - t0
    eval_batches = [micro_batch(args, args.steps, replica, k) for k in range(args.accum)]
    eval_loss = engine.eval_batch(iter(eval_batches)).item()
    exported = gather_hf_state_dict(engine, model, dst=0)
    if rank != 0:
        return 0

    # The same steps on the plain HF model, one process: the data-parallel computation.
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.0)
    ref_losses = []
    n = dp * args.accum
    reference.train()
    for step in range(args.steps):
        total = 0.0
        for d in range(dp):
            for k in range(args.accum):
                inputs, labels = micro_batch(args, step, d, k)
                loss = reference(*inputs, labels=labels).loss
                (loss / n).backward()
                total += loss.item() / n
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(total)
    reference.eval()
    ref_eval = 0.0
    with torch.no_grad():
        for d in range(dp):
            for k in range(args.accum):
                inputs, labels = micro_batch(args, args.steps, d, k)
                ref_eval += reference(*inputs, labels=labels).loss.item() / n
    ref_sd = reference.state_dict()
    weight_diff = max((exported[k].float() - ref_sd[k].float()).abs().max().item() for k in ref_sd)
    summary = {
        "family": args.family, "stages": args.stages, "data_parallel": dp, "zero": args.zero, "dtype": args.dtype,
        "activation_checkpoint_interval": args.ckpt_interval, "partition": args.partition,
        "pipeline_loss": losses, "dp_reference_loss": ref_losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "eval_loss": eval_loss, "dp_reference_eval_loss": ref_eval,
        "max_weight_diff_after_training": weight_diff, "same_hf_names": list(exported) == list(ref_sd),
        "pipeline_seconds": round(seconds, 2),
    }
    print("PARITY " + json.dumps(summary), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

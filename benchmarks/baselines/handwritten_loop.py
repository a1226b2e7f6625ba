"""The hand-written DeepSpeed loop users write (the seed articles' pattern): a model, ``deepspeed.initialize``,
then forward / backward / step on fixed token batches. One line per step on stdout from rank 0
(``step N``), which benchmarks/throughput.py timestamps itself.

    deepspeed --num_gpus 2 benchmarks/baselines/handwritten_loop.py --spec '{...}'
"""
import argparse
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import build_model, ds_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    spec = json.loads(ap.parse_args().spec)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = build_model(spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(spec))
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, spec["vocab_size"], (spec["micro_batch"], spec["seq_len"]), generator=g)
               for _ in range(4)]
    engine.train()
    for step in range(1, spec["steps"] + 1):
        ids = batches[step % len(batches)].to(engine.device)
        if spec["task"] == "causal_lm":
            loss = engine(input_ids=ids, labels=ids).loss
        else:
            labels = torch.randint(0, 2, (ids.shape[0],), generator=g).to(engine.device)
            loss = engine(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        engine.backward(loss)
        engine.step()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()

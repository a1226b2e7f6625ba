"""HF Trainer with DeepSpeed on the same model and batches (what a transformers user runs). One line per
optimizer step from rank 0 (``step N``, a TrainerCallback), timestamped by benchmarks/throughput.py.

    deepspeed --num_gpus 2 benchmarks/baselines/hf_trainer_loop.py --spec '{...}'
"""
import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import build_model, ds_config  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, spec, n=512):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, spec["vocab_size"], (n, spec["seq_len"]), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.lm = spec["task"] == "causal_lm"

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.lm:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def main() -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    spec = json.loads(ap.parse_args().spec)

    class PrintSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.is_world_process_zero:
                print(f"step {state.global_step}", flush=True)

    ds = ds_config(spec)
    ds["optimizer"]["params"]["lr"] = "auto"
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=spec["steps"], learning_rate=2e-4,
                             per_device_train_batch_size=spec["micro_batch"], weight_decay=0.0, lr_scheduler_type="constant",
                             max_grad_norm=0.0, logging_steps=10**6, save_strategy="no", report_to=[],
                             dataloader_num_workers=0, deepspeed=ds, bf16=spec["dtype"] == "bf16", seed=0,
                             disable_tqdm=True)
    torch.manual_seed(0)
    Trainer(model=build_model(spec), args=args, train_dataset=Tokens(spec), callbacks=[PrintSteps()]).train()


if __name__ == "__main__":
    main()

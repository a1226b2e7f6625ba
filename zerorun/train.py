"""Rank entry point: ``python -m zerorun.train RUN_DIR`` (started by deepspeed or torchrun).

Reads only the run dir the launcher wrote (config.yaml, ds_config.json, prepared.json), never
Hydra's argv, so what was launched is exactly what trains. Writes metrics.jsonl, checkpoints,
the exported Hugging Face model and summary.json.
"""
from __future__ import annotations

import json
import math
import os
import random
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from . import checkpoint
from .config import Dtype, RunConfig, TaskName, resolved_task, to_run_config
from .data import Prepared, RankSampler, open_split

FAULT_KILL_ENV = "ZERORUN_FAULT_KILL"  # test hook "RANK:STEP": SIGKILL that rank after that step
TRACK_MEMORY_ENV = "ZERORUN_TRACK_MEMORY"  # "1": count live tensor bytes on CPU ranks (summary.json)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


class Trainer:
    def __init__(self, run_dir: Path):
        import deepspeed
        import torch
        from omegaconf import OmegaConf

        self.torch, self.deepspeed = torch, deepspeed
        self.run_dir = run_dir
        self.cfg: RunConfig = to_run_config(OmegaConf.load(run_dir / "config.yaml"))
        self.ds_config: Dict[str, Any] = json.loads((run_dir / "ds_config.json").read_text())
        self.prepared = Prepared.load(run_dir)

        deepspeed.init_distributed()
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        from deepspeed.accelerator import get_accelerator

        self.accel = get_accelerator()
        if self.accel.device_name() == "cuda":
            self.accel.set_device(self.local_rank)

    # ------------------------------------------------------------------ setup
    def build(self) -> None:
        cfg = self.cfg
        _seed_everything(cfg.seed)  # identical initial weights on every rank
        # Every model is built whole and DeepSpeed partitions it. transformers' zero.Init path
        # (HfDeepSpeedConfig) left weights it initialises itself (random init, and the new classifier
        # head of a pretrained encoder) unset: losses of 1e26 at step 1 under ZeRO-3 with param offload.
        from .models import build_model

        self.task = resolved_task(cfg)
        model = build_model(cfg.model, self.task, cfg.task.num_labels)
        self.pipeline = cfg.parallel.mode.value == "pipeline"
        self.hf_model = model  # pipeline: the HF model whose submodules the stages wrap (export target)
        if self.pipeline:
            from .pipeline import build_pipeline_module, loss_fn_for

            # The blocks are checkpointed by the PipelineModule (ds_config "pipeline" section).
            module = build_pipeline_module(model, self.task, cfg.parallel.stages, cfg.parallel.partition,
                                           self.ds_config["pipeline"]["activation_checkpoint_interval"],
                                           loss_fn_for(self.task, model),
                                           # evaluation's last batch and the probe are smaller than a micro-batch
                                           dynamic_shape=True)
            if cfg.parallel.stages > 1:
                from .pipeline import release_other_stages

                release_other_stages(model, module)
        else:
            module = model
            if cfg.trainer.activation_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.engine, _, _, self.scheduler = self.deepspeed.initialize(
            model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=self.ds_config
        )
        if self.scheduler is not None and getattr(self.scheduler, "last_batch_iteration", 0) < 0:
            self.scheduler.step()  # DeepSpeed's schedulers start "before step 0" at lr 0; step 1 uses iteration 0
        self.device = self.engine.device
        self.train_data = open_split(self.prepared, "train")
        self.val_data = open_split(self.prepared, "val")
        self.accum = self.engine.gradient_accumulation_steps()
        # Data-parallel position: with a pipeline, the stages of one replica read the same batches.
        self.dp_rank = self.engine.grid.data_parallel_id if self.pipeline else self.rank
        self.dp_world = self.engine.dp_world_size if self.pipeline else self.world
        self.sampler = RankSampler(len(self.train_data), self.dp_rank, self.dp_world, cfg.trainer.micro_batch_size,
                                   cfg.seed, self.accum)
        self.start_step = 0
        # Per-rank randomness (dropout) differs between ranks, as in any data-parallel job.
        _seed_everything(cfg.seed + 1000 * (self.rank + 1))

    # ------------------------------------------------------------------ batches
    def _batch(self, data, idx) -> Dict[str, Any]:
        return {k: self.torch.from_numpy(v).to(self.device) for k, v in data.batch(idx).items()}

    def _pipe_item(self, data, idx):
        """One pipeline micro-batch: ((inputs...), labels) as the first and last stage expect."""
        b = self._batch(data, idx)
        inputs = (b["input_ids"], b["attention_mask"]) if "attention_mask" in b else (b["input_ids"],)
        return inputs, b["labels"]

    def _loss(self, batch: Dict[str, Any]):
        return self.engine(**batch).loss

    # ------------------------------------------------------------------ loop
    def train(self) -> Dict[str, Any]:
        torch, dist, cfg, tr = self.torch, self.dist, self.cfg, self.cfg.trainer
        metrics_path = self.run_dir / "metrics.jsonl"
        if self.rank == 0 and metrics_path.exists():
            # A fresh run starts a new file; a resumed one drops the steps it will redo, so every
            # step appears exactly once.
            kept = [line for line in metrics_path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= self.start_step]
            metrics_path.write_text("".join(line + "\n" for line in kept))
        tokens_per_step = self.ds_config["train_batch_size"] * self.prepared.seq_len
        kill_rank, kill_step = _fault_kill()
        bar = None
        if self.rank == 0 and tr.progress:
            from tqdm import tqdm

            bar = tqdm(total=tr.max_steps, initial=self.start_step, desc="train", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        history: List[Dict[str, Any]] = []
        last_ckpt: Optional[str] = None
        last_eval: Dict[str, str] = {}
        self.engine.train()
        for step in range(self.start_step + 1, tr.max_steps + 1):
            t0 = time.perf_counter()
            lr = self.engine.optimizer.param_groups[0]["lr"]  # the LR this step applies
            if self.pipeline:
                # The engine runs all micro-batches through the stages and returns their mean over
                # micro-batches and replicas, on every rank.
                items = [self._pipe_item(self.train_data, self.sampler.next_indices()) for _ in range(self.accum)]
                mean_loss = float(self.engine.train_batch(iter(items)).double().item())
            else:
                total = torch.zeros((), dtype=torch.float64, device=self.device)
                for _ in range(self.accum):
                    loss = self._loss(self._batch(self.train_data, self.sampler.next_indices()))
                    self.engine.backward(loss)
                    self.engine.step()
                    total += loss.detach().double()
                dist.all_reduce(total)
                mean_loss = (total / (self.accum * self.world)).item()
            dt = time.perf_counter() - t0
            record: Dict[str, Any] = {"step": step, "loss": mean_loss, "lr": lr, "tokens_per_s": tokens_per_step / dt,
                                      "step_time_s": dt, "epoch": self.sampler.epoch,
                                      "skipped_steps": int(getattr(self.engine, "skipped_steps", 0))}
            if cfg.precision.dtype == Dtype.fp16:
                record["loss_scale"] = _loss_scale(self.engine)
            if tr.eval_every and step % tr.eval_every == 0 and step != tr.max_steps:
                record.update(self.evaluate())
            history.append(record)
            if self.rank == 0:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                if bar is not None:
                    if "val_loss" in record:  # the latest evaluation stays on the progress line
                        last_eval = {k: f"{v:.4g}" for k, v in record.items() if k.startswith("val_")}
                    bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", **last_eval)
                    bar.update(1)
            if (tr.save_every and step % tr.save_every == 0) or step == tr.max_steps:
                last_ckpt = self.save(step)
            if kill_rank == self.rank and kill_step == step:
                os.kill(os.getpid(), signal.SIGKILL)
        if bar is not None:
            bar.close()
        final_eval = self.evaluate()
        return {"history": history, "checkpoint": last_ckpt, "final_eval": final_eval}

    # ------------------------------------------------------------------ eval
    def evaluate(self) -> Dict[str, Any]:
        """Validation loss over the whole validation set (split across ranks), with perplexity (LM)
        or accuracy and macro-F1 (classification)."""
        torch = self.torch
        if len(self.val_data) == 0:
            return {}
        self.engine.eval()
        classify = self.task == TaskName.sequence_classification
        n_labels = self.cfg.task.num_labels
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, examples
        confusion = torch.zeros(n_labels, n_labels, dtype=torch.float64, device=self.device)  # [true, predicted]
        mb = self.cfg.trainer.micro_batch_size
        mine = list(range(self.dp_rank, len(self.val_data), self.dp_world))
        # Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively, pipeline
        # stages exchange activations); a rank with no rows left runs row 0 with weight 0.
        n_batches = math.ceil(math.ceil(len(self.val_data) / self.dp_world) / mb)
        # A pipeline's loss and logits live on its last stage; only that stage counts them.
        counts = not self.pipeline or self.engine.is_last_stage()
        with torch.no_grad():
            for b in range(n_batches):
                idx = mine[b * mb:(b + 1) * mb]
                batch = self._batch(self.val_data, idx or [0])
                if self.pipeline:
                    loss, logits = self.engine.eval_batch(iter([self._pipe_item(self.val_data, idx or [0])]),
                                                          return_logits=True, num_micro_batches=1)
                else:
                    out = self.engine(**batch)
                    loss, logits = out.loss, out.logits
                if not idx or not counts:
                    continue
                total += torch.tensor([loss.double().item() * len(idx), len(idx)], dtype=torch.float64,
                                      device=self.device)
                if classify:
                    pred = logits.argmax(-1)
                    confusion.index_put_((batch["labels"], pred), torch.ones_like(pred, dtype=torch.float64),
                                         accumulate=True)
        self.dist.all_reduce(total)
        self.engine.train()
        val_loss = (total[0] / total[1]).item()
        if not classify:
            return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50.0))}
        self.dist.all_reduce(confusion)
        return {"val_loss": val_loss, **classification_metrics(confusion.cpu().numpy())}

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> str:
        client_state = {"step": step, "consumed": self.sampler.consumed}
        return checkpoint.save(self.engine, self.run_dir / "checkpoints", step, client_state,
                               rng_state=_rng_state(), rank=self.rank, barrier=self.dist.barrier,
                               keep_last=self.cfg.trainer.keep_last)

    def resume(self, ckpt_root: Path, tag: str) -> None:
        client_state, rng = checkpoint.load(self.engine, ckpt_root, tag, rank=self.rank)
        self.start_step = int(client_state["step"])
        self.sampler.consumed = int(client_state["consumed"])
        if rng is not None:
            _set_rng_state(rng)

    # ------------------------------------------------------------------ export
    def export(self) -> Optional[str]:
        """Save the final model in Hugging Face format (ZeRO-3 weights gathered) plus a logits probe."""
        torch = self.torch
        out = self.run_dir / "export"
        if self.pipeline:
            from .pipeline import gather_hf_state_dict

            state_dict = gather_hf_state_dict(self.engine, self.hf_model)  # collective; rank 0 gets it
        elif self.cfg.zero.stage == 3:
            state_dict = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state_dict = self.engine.module.state_dict()
        # Probe: the engine's own logits on a fixed input, to check the export against.
        source = self.val_data if len(self.val_data) else self.train_data
        probe = {k: v for k, v in self._batch(source, [0, min(1, len(source) - 1)]).items() if k != "labels"}
        probe["input_ids"] = probe["input_ids"][:, :32]
        if "attention_mask" in probe:
            probe["attention_mask"] = probe["attention_mask"][:, :32]
        self.engine.eval()
        with torch.no_grad():
            if self.pipeline:
                inputs = (probe["input_ids"], probe["attention_mask"]) if "attention_mask" in probe \
                    else (probe["input_ids"],)
                labels = probe["input_ids"] if self.task == TaskName.causal_lm else torch.zeros(
                    len(probe["input_ids"]), dtype=torch.long, device=self.device)
                _, logits = self.engine.eval_batch(iter([(inputs, labels)]), return_logits=True, num_micro_batches=1)
                # The last stage holds the logits: send them to rank 0 for the probe file.
                holder = [logits.float().cpu() if self.engine.is_last_stage() and self.engine.grid.data_parallel_id == 0
                          else None]
                gathered = [None] * self.world
                self.dist.all_gather_object(gathered, holder[0])
                logits = next(g for g in gathered if g is not None)
            else:
                logits = self.engine.module(**probe).logits.float().cpu()
        self.engine.train()
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            hf = self.hf_model if self.pipeline else self.engine.module
            hf.save_pretrained(str(out), state_dict=state_dict, safe_serialization=True)
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(self.prepared.tokenizer_dir).save_pretrained(str(out))
            torch.save({"inputs": {k: v.cpu() for k, v in probe.items()}, "task": self.task.value, "logits": logits,
                        "dtype": str(next(self.engine.module.parameters()).dtype).replace("torch.", "")},
                       out / "probe.pt")
        self.dist.barrier()
        return str(out)


def classification_metrics(confusion: np.ndarray) -> Dict[str, float]:
    """Accuracy and macro-F1 from a [true, predicted] count matrix."""
    tp = np.diag(confusion)
    precision = np.divide(tp, confusion.sum(0), out=np.zeros_like(tp), where=confusion.sum(0) > 0)
    recall = np.divide(tp, confusion.sum(1), out=np.zeros_like(tp), where=confusion.sum(1) > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=(precision + recall) > 0)
    return {"val_accuracy": float(tp.sum() / max(confusion.sum(), 1)), "val_f1": float(f1.mean())}


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> Dict[str, Any]:
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _loss_scale(engine) -> Optional[float]:
    opt = engine.optimizer
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(opt, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
        if value is not None and hasattr(value, "item"):
            return float(value.item())
    return None


def _fault_kill():
    spec = os.environ.get(FAULT_KILL_ENV, "")
    if not spec:
        return None, None
    rank, step = spec.split(":")
    return int(rank), int(step)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    args = [a for a in args if not a.startswith("--local_rank")]
    if len(args) != 1:
        print("usage: python -m zerorun.train RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0]).resolve()
    t_start = time.time()
    # Opt-in live-tensor accounting (CPU ranks): every storage an op creates, from before the model is built,
    # so the init and training peaks compare with the estimate's allocator peak. It slows every op.
    tracker = None
    if os.environ.get(TRACK_MEMORY_ENV) == "1":
        from .memory_measure import live_bytes

        tracker = live_bytes()
        tracker.__enter__()
    trainer = Trainer(run_dir)
    trainer.build()
    init_live_peak = tracker.peak if tracker else 0
    if tracker:
        tracker.reset_peak()
    resume = json.loads((run_dir / "resume.json").read_text()) if (run_dir / "resume.json").exists() else None
    if resume:
        trainer.resume(Path(resume["checkpoint_dir"]), resume["tag"])
    result = trainer.train()
    train_live_peak = tracker.peak if tracker else 0
    if tracker:
        tracker.__exit__(None, None, None)
    export_dir = trainer.export() if trainer.cfg.trainer.export else None

    import torch

    states = model_state_bytes(trainer.engine)
    peak = torch.tensor([peak_rss_bytes(), _accelerator_peak(trainer), states["parameters"], states["fp32_master"],
                         states["optimizer_states"], init_live_peak, train_live_peak,
                         trainer.engine.stage_id if trainer.pipeline else -1], dtype=torch.float64)
    gathered = [torch.zeros_like(peak) for _ in range(trainer.world)]
    trainer.dist.all_gather(gathered, peak)
    if trainer.rank == 0:
        history = result["history"]
        speeds = [h["tokens_per_s"] for h in history[1:]] or [h["tokens_per_s"] for h in history]
        estimate = (json.loads((run_dir / "estimate.json").read_text())
                    if (run_dir / "estimate.json").exists() else None)
        summary = {
            "status": "completed",
            "steps": trainer.cfg.trainer.max_steps,
            "resumed_from_step": trainer.start_step,
            "final_loss": history[-1]["loss"] if history else None,
            "first_loss": history[0]["loss"] if history else None,
            "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
            "world_size": trainer.world,
            "accelerator": trainer.accel.device_name(),
            "peak_memory": [
                {"rank": r, "peak_rss_bytes": int(g[0]), "accelerator_peak_allocated_bytes": int(g[1]),
                 "model_state_bytes": {"parameters": int(g[2]), "fp32_master": int(g[3]),
                                       "optimizer_states": int(g[4])},
                 **({"live_tensor_peak_bytes": {"init": int(g[5]), "train": int(g[6])}} if tracker else {}),
                 **({"pipeline_stage": int(g[7])} if trainer.pipeline else {})}
                for r, g in enumerate(gathered)
            ],
            "peak_memory_measures": ("accelerator_peak_allocated_bytes = torch.cuda.max_memory_allocated (0 on CPU); "
                                     "peak_rss_bytes = the rank process's peak resident set (getrusage: includes "
                                     "Python, torch and DeepSpeed themselves); model_state_bytes = the parameter, "
                                     "fp32-master and optimizer-state tensors DeepSpeed holds on the rank at the end"
                                     + ("; live_tensor_peak_bytes = peak bytes of live CPU tensor storages "
                                        f"({TRACK_MEMORY_ENV}=1), in model build + deepspeed.initialize (init) and "
                                        "in the training loop (train)" if tracker else "")),
            "estimated_components": (estimate or {}).get("components"),
            "estimated_peak_bytes": (estimate or {}).get("per_rank_peak_bytes"),
            "checkpoint": result["checkpoint"],
            "export": export_dir,
            "wall_time_s": time.time() - t_start,
            **result["final_eval"],
        }
        _write_json_atomic(run_dir / "summary.json", summary)
        print(f"zerorun: done. final loss {summary['final_loss']:.4f}, {summary['tokens_per_s']:.0f} tokens/s; "
              f"summary in {run_dir / 'summary.json'}", file=sys.stderr)
    trainer.dist.barrier()
    _release_cpu_shm(trainer)
    return 0


def _release_cpu_shm(trainer: Trainer) -> None:
    """After the last collective, unlink this rank's DeepSpeed CPU all-reduce segment (see
    launcher.cpu_shm_name); the mapping stays valid for anyone still holding it."""
    if trainer.accel.device_name() != "cpu":
        return
    from .launcher import release_cpu_shm

    release_cpu_shm(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), trainer.rank)


def model_state_bytes(engine) -> Dict[str, int]:
    """Bytes of model state this rank actually holds after training, by kind, from DeepSpeed's own
    tensors: the module's parameters (ZeRO-3: this rank's partition), the fp32 master partitions and
    the optimizer's state tensors. Counted once per storage. Gradients are freed between steps and
    activations live only inside a step, so neither is here (peak_rss_bytes covers the whole process)."""
    import torch

    seen, out = set(), {"parameters": 0, "fp32_master": 0, "optimizer_states": 0}

    def add(kind: str, t) -> None:
        if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out[kind] += t.untyped_storage().nbytes()

    for p in engine.module.parameters():
        add("parameters", getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p)
    opt = engine.optimizer
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat",
                 "fp32_groups_flat_partition"):  # the last: BF16_Optimizer (pipeline + bf16 + ZeRO-0)
        for t in getattr(opt, attr, None) or []:
            add("fp32_master", t)
    inner = getattr(opt, "optimizer", opt)
    for state in getattr(inner, "state", {}).values():
        for t in state.values():
            add("optimizer_states", t)
    return out


def _accelerator_peak(trainer: Trainer) -> int:
    if trainer.accel.device_name() == "cuda":
        return int(trainer.torch.cuda.max_memory_allocated())
    return 0


if __name__ == "__main__":
    sys.exit(main())

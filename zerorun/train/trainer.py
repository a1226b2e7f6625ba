"""The rank's training loop: engine setup, optimizer steps, evaluation, checkpoints.

What the launcher resolved (config, plan, DeepSpeed JSON, prepared data) is read from the run dir;
how the model is split across ranks is the strategy's business (strategy.py).
"""
from __future__ import annotations

import math
import os
import random
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

from .. import checkpoint, faults
from ..quiet import LIBRARY_LOG, library_stdout, quiet_libraries
from ..config import Dtype, TaskName
from ..data import RankSampler, open_split
from ..rundir import RunDir
from ..telemetry import RssMilestones
from . import dropout_masks, heap_limit, interrupts, optimizers
from .strategy import strategy_for


def init_distributed(**kwargs) -> None:
    """``deepspeed.init_distributed`` without DeepSpeed's shared-memory all-reduce op on CPU ranks. DeepSpeed's
    TorchBackend loads that op at init (JIT-compiling it where it is not built: ~40 s), and it maps ~66 MB of
    /dev/shm per rank that DeepSpeed never unlinks; yet training never calls it. Only ``inference_all_reduce``
    does (DeepSpeed inference, ``LmHeadLinearAllreduce``), and that falls back to torch.distributed's all-reduce
    without it; every training collective, AutoTP's included, is torch.distributed's (deepspeed/comm/torch.py,
    module_inject/layers.py RowParallel). ``__compatible_ops__`` is the switch build_shm_op reads. Also sets the
    compile flags of the ops a rank may load (zerorun.ops.set_build_flags)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ..ops import set_build_flags

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    set_build_flags()  # before any op loads (cpu_adam, async_io): the flags the prebuild compiled them with
    deepspeed.init_distributed(**kwargs)


class Trainer:
    def __init__(self, run_dir: RunDir):
        import deepspeed
        import torch
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator

        self.torch, self.deepspeed, self.dist = torch, deepspeed, dist
        self.run_dir = run_dir
        self.cfg = run_dir.read_config()
        self.plan = run_dir.read_plan()
        self.ds_config: Dict[str, Any] = run_dir.read_ds_config()
        self.prepared = run_dir.read_prepared()
        self.task = self.plan.task
        self.strategy = strategy_for(self.cfg, self.plan, self.ds_config)

        # A peer that died leaves the others in a collective: fail after trainer.collective_timeout_s,
        # not torch's 30 minutes (the launcher also stops the group when one rank exits).
        from datetime import timedelta

        with library_stdout(self.cfg.verbose):
            init_distributed(timeout=timedelta(seconds=self.cfg.trainer.collective_timeout_s))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        # Who writes the run dir's metrics, summary and checkpoint markers: rank 0, and with a run dir per
        # node (launcher.shared_run_dir=false) local rank 0 of every node, so each node's is complete.
        self.writes_run_dir = self.rank == 0 or (self.cfg.launcher.node_local_run_dirs and self.local_rank == 0)
        self.accel = get_accelerator()
        if self.accel.device_name() == "cuda":
            self.accel.set_device(self.local_rank)  # before the first collective: NCCL uses the current device
        _agree_or_leave(run_dir, dist, self.rank)
        from ..arch import model_code
        from ..models import import_model_code

        import_model_code(model_code(self.cfg.model))
        self.stop = interrupts.StopFlag(run_dir.path, dist)  # a signal from here on stops at a step boundary
        self.rss = RssMilestones()
        self.heap_limit: Dict[str, Any] = {}  # the ceiling on a CPU rank's tcmalloc heap (hold_heap)
        self.rss.mark("ready")  # every import and the process group, no tensor yet: the process baseline

    # ------------------------------------------------------------------ setup
    def build(self) -> None:
        from ..models import build_model

        cfg = self.cfg
        quiet_libraries(cfg.verbose, self.run_dir.path / LIBRARY_LOG if self.writes_run_dir else None)
        seed_everything(cfg.seed)  # identical initial weights on every rank
        # Every model is built whole and DeepSpeed partitions it. transformers' zero.Init path
        # (HfDeepSpeedConfig) left weights it initialises itself (random init, and the new classifier
        # head of a pretrained encoder) unset: losses of 1e26 at step 1 under ZeRO-3 with param offload.
        quantized = cfg.precision.dtype.value if cfg.adapter.name.value == "qlora" else ""
        self.hf_model = build_model(cfg.model, self.task, cfg.task.num_labels, quantized=quantized,
                                    device=self.accel.device_name(self.local_rank)
                                    if quantized and self.plan.world.accelerator == "cuda" else "cpu")
        module = self.strategy.module(self.hf_model)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.engine, _, _, self.scheduler = self.deepspeed.initialize(
            model=module, model_parameters=trainable, optimizer=optimizers.build(cfg, self.plan, trainable),
            config=self.ds_config)
        if self.scheduler is not None and getattr(self.scheduler, "last_batch_iteration", 0) < 0:
            self.scheduler.step()  # DeepSpeed's schedulers start "before step 0" at lr 0; step 1 uses iteration 0
        self.device = self.engine.device
        self.strategy.attach(self.engine, self.rank, self.world)
        if self.engine.gradient_accumulation_steps() != self.plan.grad_accum_steps:
            raise RuntimeError(f"DeepSpeed runs {self.engine.gradient_accumulation_steps()} micro-batches per step, "
                               f"the plan {self.plan.grad_accum_steps}: plan.json and ds_config.json disagree")
        self.train_data = open_split(self.prepared, "train")
        self.val_data = open_split(self.prepared, "val")
        lengths = getattr(self.train_data, "lengths", None)
        self.sampler = RankSampler(len(self.train_data), self.strategy.dp_rank, self.strategy.dp_world,
                                   self.plan.micro_batch_size, cfg.seed, self.plan.grad_accum_steps,
                                   lengths=lengths if cfg.data.group_by_length else None)
        self.tokens_seen = [0, 0]  # this rank's non-pad and padded tokens in the batches it trained on
        self.start_step = 0
        self.step = 0  # the step being run (fault records name it)
        self.rss.mark("built")
        interrupts.limit_memory(self.rank)
        if cfg.trainer.fast_dropout_masks and self.plan.world.accelerator == "cpu":
            dropout_masks.install()
        # Per-rank randomness (dropout) differs between ranks, as in any data-parallel job.
        seed_everything(cfg.seed + 1000 * (self.rank + 1))

    def hold_heap(self) -> None:
        """Hold a CPU rank's tcmalloc heap under its share of host RAM (launcher.heap_limit_mib) from here to the
        end: after the build and a resume, whose load holds a second copy of the states for a moment (torch.load,
        then copied into place) that the estimate's training phases do not count."""
        if self.plan.world.accelerator == "cpu":  # what runs out is host RAM (GPU ranks: device memory)
            self.heap_limit = heap_limit.apply(self.cfg.launcher.heap_limit_mib, self.run_dir.read_estimate() or {},
                                               self.rank, self.engine.stage_id if self.strategy.pipeline else None)

    def batch(self, data, idx) -> Dict[str, Any]:
        return {k: self.torch.from_numpy(v).to(self.device) for k, v in data.batch(idx).items()}

    # ------------------------------------------------------------------ loop
    def train(self) -> Dict[str, Any]:
        cfg, tr = self.cfg, self.cfg.trainer
        if self.writes_run_dir:
            self.run_dir.start_metrics(keep_through_step=self.start_step)
        bar = None
        if self.writes_run_dir and tr.progress:
            from tqdm import tqdm

            bar = tqdm(total=tr.max_steps, initial=self.start_step, desc="train", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        history: List[Dict[str, Any]] = []
        last_ckpt: Optional[str] = None
        preempted: Optional[Dict[str, Any]] = None
        last_eval: Dict[str, str] = {}
        accum = self.plan.grad_accum_steps
        self.engine.train()
        for step in range(self.start_step + 1, tr.max_steps + 1):
            self.step = step
            interrupts.inject_oom(self.rank, step, self.plan.micro_batch_size)
            t0 = time.perf_counter()
            lr = self.engine.optimizer.param_groups[0]["lr"]  # the LR this step applies
            drawn = [self.sampler.next_indices() for _ in range(accum)]
            self._count_tokens(drawn)
            mean_loss = self.strategy.train_step([self.batch(self.train_data, idx) for idx in drawn])
            dt = time.perf_counter() - t0
            # One all-reduce per step: whether any rank must stop, and which sequences the step used.
            why, fingerprint = self.stop.agreed(self.device, drawn, self.world // max(1, self.strategy.dp_world))
            why = why if step < tr.max_steps else None
            record: Dict[str, Any] = {"step": step, "loss": mean_loss, "lr": lr, "data_fingerprint": fingerprint,
                                      "tokens_per_s": self.plan.tokens_per_step / dt, "step_time_s": dt,
                                      "epoch": self.sampler.epoch,
                                      "skipped_steps": int(getattr(self.engine, "skipped_steps", 0))}
            if cfg.precision.dtype == Dtype.fp16:
                record["loss_scale"] = _loss_scale(self.engine)
            if tr.eval_every and step % tr.eval_every == 0 and step != tr.max_steps:
                record.update(self.evaluate())
            history.append(record)
            self._monitor(record)
            if self.writes_run_dir:
                self.run_dir.append_metrics([record])
                if bar is not None:
                    if "val_loss" in record:  # the latest evaluation stays on the progress line
                        last_eval = {k: f"{v:.4g}" for k, v in record.items() if k.startswith("val_")}
                    bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", **last_eval)
                    bar.update(1)
            saved = (tr.save_every and step % tr.save_every == 0) or step == tr.max_steps
            if saved:
                last_ckpt = self.save(step)
            interrupts.kill_after(self.run_dir.path, self.rank, step)
            if step == self.start_step + 1:
                self.rss.mark("first step")
            if why:  # preemption: every rank saves this step and leaves, well inside a grace period
                last_ckpt = last_ckpt if saved else self.save(step)
                preempted = {"step": step, "signal": why, "checkpoint": last_ckpt}
                break
        if bar is not None:
            bar.close()
        if preempted:
            return {"history": history, "checkpoint": last_ckpt, "preempted": preempted}
        self.rss.mark("trained")
        final_eval = self.evaluate()
        self.rss.mark("evaluated")
        seen = self.torch.tensor(self.tokens_seen, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(seen)
        non_pad = float(seen[0] / seen[1]) if seen[1] else 1.0
        return {"history": history, "checkpoint": last_ckpt, "final_eval": final_eval, "non_pad_fraction": non_pad}

    def _monitor(self, record: Dict[str, Any]) -> None:
        """The step's figures to DeepSpeed's own monitor (monitor=tensorboard|csv|wandb; it writes on rank 0)."""
        monitor = getattr(self.engine, "monitor", None)
        if monitor is None or not monitor.enabled or self.rank != 0:
            return
        names = {"loss": "train_loss", "tokens_per_s": "tokens_per_s", **{k: k for k in record if k.startswith("val_")}}
        monitor.write_events([(f"Train/Samples/{name}", float(record[k]), self.engine.global_samples)
                              for k, name in names.items() if isinstance(record.get(k), (int, float))])

    def _count_tokens(self, drawn) -> None:
        """Padded vs real tokens of this step's micro-batches (each padded to its longest; LM blocks: none)."""
        lengths = getattr(self.train_data, "lengths", None)
        for idx in drawn:
            if lengths is None:
                n = len(idx) * self.plan.seq_len
                self.tokens_seen[0] += n
                self.tokens_seen[1] += n
            else:
                ls = lengths[idx]
                self.tokens_seen[0] += int(ls.sum())
                self.tokens_seen[1] += int(ls.max()) * len(idx)

    # ------------------------------------------------------------------ eval
    def evaluate(self) -> Dict[str, Any]:
        """Validation loss over the whole validation set (split across replicas), with perplexity (LM)
        or accuracy and macro-F1 (classification)."""
        torch = self.torch
        if len(self.val_data) == 0:
            return {}
        self.engine.eval()
        classify = self.task == TaskName.sequence_classification
        n_labels = self.cfg.task.num_labels
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, examples
        confusion = torch.zeros(n_labels, n_labels, dtype=torch.float64, device=self.device)  # [true, predicted]
        mb, dp_rank, dp_world = self.plan.micro_batch_size, self.strategy.dp_rank, self.strategy.dp_world
        mine = list(range(dp_rank, len(self.val_data), dp_world))
        # Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively, pipeline
        # stages exchange activations); a rank with no rows left runs row 0 with weight 0.
        n_batches = math.ceil(math.ceil(len(self.val_data) / dp_world) / mb)
        with torch.no_grad():
            for b in range(n_batches):
                self._eval_batch(mine[b * mb:(b + 1) * mb], total, confusion if classify else None)
        self.dist.all_reduce(total)
        self.engine.train()
        val_loss = (total[0] / total[1]).item()
        if not classify:
            return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50.0))}
        self.dist.all_reduce(confusion)
        return {"val_loss": val_loss, **classification_metrics(confusion.cpu().numpy())}

    def _eval_batch(self, idx: List[int], total, confusion) -> None:
        """One validation batch into ``total`` (and ``confusion``), in a function of its own so that its outputs are
        freed when it returns: a loop variable would hold this batch's logits (b·s·V) through the next forward."""
        torch = self.torch
        batch = self.batch(self.val_data, idx or [0])
        loss, logits = self.strategy.forward(batch)
        if not idx or not self.strategy.holds_outputs:
            return
        total += torch.tensor([loss.double().item() * len(idx), len(idx)], dtype=torch.float64, device=self.device)
        if confusion is not None:
            pred = logits.argmax(-1)
            confusion.index_put_((batch["labels"], pred), torch.ones_like(pred, dtype=torch.float64), accumulate=True)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int) -> str:
        client_state = {"step": step, "consumed": self.sampler.consumed, "run": checkpoint.identity(self.cfg)}
        root = self.run_dir.checkpoints_for(self.cfg)
        try:
            return self._save(root, step, client_state)
        except Exception as e:  # noqa: BLE001 (only a full disk is turned into something else)
            # A peer that hit the full disk leaves its record before leaving: this rank's broken collective is that.
            peer = not faults.is_disk_full(e, root) and faults.await_record(self.run_dir.path, "disk_full")
            if not (peer or faults.is_disk_full(e, root)):
                raise
            raise faults.DiskFull(str(root), step, checkpoint.latest_tag(root) or "", str(root / checkpoint.tag_for(step)),
                                  str(e).splitlines()[0][:300] if str(e) else type(e).__name__, peer=peer) from None

    def _save(self, root, step: int, client_state) -> str:
        return checkpoint.save(self.engine, root, step, client_state,
                               rng_state=rng_state(), rank=self.rank, writer=self.writes_run_dir,
                               barrier=self.dist.barrier,
                               keep_last=self.cfg.trainer.keep_last,
                               world={"ranks": self.world, "data_parallel": self.strategy.dp_world,
                                      "tensor_parallel": self.plan.tensor_parallel,
                                      "global_batch": self.plan.global_batch_size,
                                      "optimizer": self.plan.optimizer.value},
                               at_point=interrupts.save_hook(self.rank, step, root),
                               frozen_base=self.cfg.adapter.name.adapts)

    def resume(self, ckpt_root, tag: str) -> None:
        client_state, rng = checkpoint.load(self.engine, ckpt_root, tag, rank=self.rank,
                                            frozen_base=self.cfg.adapter.name.adapts)
        self.start_step = int(client_state["step"])
        # Step k takes the k-th global batch whatever the split (RankSampler), so the position follows
        # from the step: exact also when the micro-batch, accumulation or rank count changed since the save.
        self.sampler.consumed = self.start_step * self.plan.grad_accum_steps
        if rng is not None:
            set_rng_state(rng)


def classification_metrics(confusion: np.ndarray) -> Dict[str, float]:
    """Accuracy and macro-F1 from a [true, predicted] count matrix."""
    tp = np.diag(confusion)
    precision = np.divide(tp, confusion.sum(0), out=np.zeros_like(tp), where=confusion.sum(0) > 0)
    recall = np.divide(tp, confusion.sum(1), out=np.zeros_like(tp), where=confusion.sum(1) > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=(precision + recall) > 0)
    return {"val_accuracy": float(tp.sum() / max(confusion.sum(), 1)), "val_f1": float(f1.mean())}


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> Dict[str, Any]:
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
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


def _agree_or_leave(run_dir: RunDir, dist, rank: int) -> None:
    """Multi-node: before the model is built, every node must run the same software, config and data."""
    from .. import faults
    from . import preflight

    problems = preflight.check(dist, rank, run_dir.path)
    if not problems:
        return
    faults.record(run_dir.path, rank, "preflight", problems=problems)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        for p in problems:
            print(f"zerorun: preflight: {p}", file=sys.stderr, flush=True)
    os._exit(faults.EXIT_BAD_INPUT)

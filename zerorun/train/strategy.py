"""How a rank runs one kind of parallelism: data parallel (ZeRO), tensor parallel (AutoTP) or a DeepSpeed pipeline.

The trainer's loop, evaluation and export are the same for both; what differs is here: the module
handed to DeepSpeed, how a step consumes its micro-batches, where the loss and logits live, which
data-parallel replica a rank belongs to, and how the whole model's weights are gathered for export.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..config import Plan, RunConfig, TaskName


class DataParallel:
    """Every rank holds the whole model (ZeRO partitions its states); each rank is its own replica."""

    pipeline = False

    def __init__(self, cfg: RunConfig, plan: Plan, ds_config: Dict[str, Any]):
        self.cfg, self.plan = cfg, plan

    def module(self, model):
        ckpt = self.cfg.trainer.activation_checkpointing
        if ckpt and self.cfg.adapter.name.value != "qlora":  # QLoRA's kbit preparation turns it on itself
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.plan.fused_loss:
            from .fused_loss import install

            install(model)  # before peft wraps it: peft's forward calls this model's
        if self.cfg.adapter.name.adapts:
            from ..models import with_lora

            return with_lora(model, self.cfg.model, self.cfg.adapter, self.plan.task, ckpt)
        return model

    def attach(self, engine, rank: int, world: int) -> None:
        self.engine, self.dp_rank, self.dp_world, self.world = engine, rank, world, world

    def train_step(self, batches: List[Dict[str, Any]]) -> float:
        """Forward/backward/step for each micro-batch; the mean loss over micro-batches and ranks."""
        import torch
        import torch.distributed as dist

        engine = self.engine
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        for batch in batches:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        dist.all_reduce(total)
        return (total / (len(batches) * self.world)).item()

    def forward(self, batch: Dict[str, Any]) -> Tuple[Any, Any]:
        """(loss, logits) of one batch in eval mode."""
        out = self.engine(**batch)
        return out.loss, out.logits

    @property
    def holds_outputs(self) -> bool:
        """Whether this rank sees the loss and logits (and so counts them in evaluation)."""
        return True

    def state_dict(self, hf_model) -> Optional[Dict[str, Any]]:
        """The whole model's weights under Hugging Face names, on rank 0 (collective under ZeRO-3)."""
        if self.cfg.zero.stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return self.engine.module.state_dict()

    def export_model(self, hf_model):
        return self.engine.module  # a PeftModel with adapter=lora

    def probe_logits(self, probe: Dict[str, Any], task: TaskName):
        return self.engine.module(**probe).logits.float().cpu()


class TensorParallel(DataParallel):
    """DeepSpeed AutoTP (ds_config ``tensor_parallel.autotp_size``): deepspeed.initialize replaces each attention and
    MLP projection (and an untied LM head) with a shard of it, over groups of ``plan.tensor_parallel`` consecutive
    ranks; ZeRO runs over the data-parallel groups across them. The ranks of one group compute the same loss on the
    same batch (DeepSpeed checks the first one), so the data is split by the data-parallel rank."""

    def attach(self, engine, rank: int, world: int) -> None:
        from deepspeed.utils import groups

        self.engine, self.world = engine, world
        self.dp_rank, self.dp_world = groups.get_data_parallel_rank(), groups.get_data_parallel_world_size()
        self.tp_rank = groups.get_tensor_model_parallel_rank()
        if self.dp_world * self.plan.tensor_parallel != world:
            raise RuntimeError(f"DeepSpeed built {self.dp_world} data-parallel groups for {world} ranks, the plan "
                               f"tensor parallelism {self.plan.tensor_parallel} × {self.plan.data_parallel_size}")

    @property
    def holds_outputs(self) -> bool:
        return self.tp_rank == 0  # every rank of a group has the same loss and logits: count them once

    def state_dict(self, hf_model) -> Optional[Dict[str, Any]]:
        """The shards gathered into whole tensors under their Hugging Face names, on rank 0 (collective): ZeRO-3
        gathers over both dimensions, below it AutoTP's own consolidation (engine._consolidated_16bit_state_dict,
        which keeps the module's dtype)."""
        if self.cfg.zero.stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return self.engine._consolidated_16bit_state_dict()


class Pipeline:
    """The model cut into stages (zerorun.pipeline); a replica is one rank per stage."""

    pipeline = True

    def __init__(self, cfg: RunConfig, plan: Plan, ds_config: Dict[str, Any]):
        self.cfg, self.plan, self.ds_config = cfg, plan, ds_config

    def module(self, model):
        from ..pipeline import build_pipeline_module, loss_fn_for, release_other_stages

        # The blocks are checkpointed by the PipelineModule (ds_config "pipeline" section).
        module = build_pipeline_module(model, self.plan.task, self.plan.pipeline_stages, self.cfg.parallel.partition,
                                       self.ds_config["pipeline"]["activation_checkpoint_interval"],
                                       loss_fn_for(self.plan.task),
                                       # evaluation's last batch and the probe are smaller than a micro-batch
                                       dynamic_shape=True)
        if self.plan.pipeline_stages > 1:
            # Every rank built the whole fp32 model; keep only this stage's weights alive.
            release_other_stages(model, module)
        return module

    def attach(self, engine, rank: int, world: int) -> None:
        # Data-parallel position: the stages of one replica read the same batches.
        self.engine, self.world = engine, world
        self.dp_rank, self.dp_world = engine.grid.data_parallel_id, engine.dp_world_size

    @staticmethod
    def _item(batch: Dict[str, Any]):
        """One pipeline micro-batch: ((inputs...), labels) as the first and last stage expect."""
        inputs = (batch["input_ids"], batch["attention_mask"]) if "attention_mask" in batch else (batch["input_ids"],)
        return inputs, batch["labels"]

    def train_step(self, batches: List[Dict[str, Any]]) -> float:
        # The engine streams all micro-batches through the stages and returns their mean over
        # micro-batches and replicas, on every rank.
        return float(self.engine.train_batch(iter([self._item(b) for b in batches])).double().item())

    def forward(self, batch: Dict[str, Any]) -> Tuple[Any, Any]:
        return self.engine.eval_batch(iter([self._item(batch)]), return_logits=True, num_micro_batches=1)

    @property
    def holds_outputs(self) -> bool:
        return self.engine.is_last_stage()  # the loss and logits live on the last stage

    def state_dict(self, hf_model) -> Optional[Dict[str, Any]]:
        from ..pipeline import gather_hf_state_dict

        return gather_hf_state_dict(self.engine, hf_model)  # collective; rank 0 gets it

    def export_model(self, hf_model):
        return hf_model  # the HF model whose submodules the stages wrap

    def probe_logits(self, probe: Dict[str, Any], task: TaskName):
        import torch
        import torch.distributed as dist

        labels = probe["input_ids"] if task == TaskName.causal_lm else torch.zeros(
            len(probe["input_ids"]), dtype=torch.long, device=probe["input_ids"].device)
        _, logits = self.forward({**probe, "labels": labels})
        # The last stage holds the logits: send them to rank 0 for the probe file.
        mine = logits.float().cpu() if self.holds_outputs and self.dp_rank == 0 else None
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine)
        return next(g for g in gathered if g is not None)


def strategy_for(cfg: RunConfig, plan: Plan, ds_config: Dict[str, Any]):
    kind = Pipeline if plan.pipeline else TensorParallel if plan.tensor_parallel > 1 else DataParallel
    return kind(cfg, plan, ds_config)

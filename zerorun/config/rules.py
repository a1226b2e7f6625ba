"""What goes with what: the one place for each rule that several parts of zerorun need.

``check`` refuses what breaks a rule, autofit and the estimate table walk ``layouts()``, the memory
measurement matrix is drawn from it, and the tests hold it against DeepSpeed's own behaviour.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional

from .errors import UserError
from .schema import AdapterName, Family, OffloadDevice, OptimizerName, ParallelMode, TaskName

# ---------------------------------------------------------------------------------------------
# Where model states live: ZeRO stage × offload device × parameter offload


@dataclass(frozen=True)
class Layout:
    """A ZeRO stage, where optimizer states go, and whether parameters go there too (ZeRO-3 only)."""

    stage: int
    device: OffloadDevice
    params: bool

    @property
    def label(self) -> str:
        if self.device == OffloadDevice.none:
            return "none"
        if self.stage < 3:
            return self.device.value
        return f"{self.device.value} ({'+params' if self.params else 'optimizer'})"


def params_offloaded(stage: int, device: OffloadDevice, params: Optional[bool]) -> bool:
    """Parameters are offloaded: ZeRO-3 with an offload device and offload.params not false (unset = yes)."""
    return stage == 3 and OffloadDevice(device) != OffloadDevice.none and params is not False


def offload_problems(stage: int, device: OffloadDevice, params: Optional[bool]) -> List[UserError]:
    """DeepSpeed's rules for offload (ZeRO-Offload / ZeRO-Infinity)."""
    device = OffloadDevice(device)
    out = []
    if device != OffloadDevice.none and stage == 0:
        out.append(UserError(
            f"offload={device.value} with zero.stage=0: DeepSpeed offloads only ZeRO-partitioned state.",
            "zero=stage2 (optimizer offload) or zero=stage3 (parameters too), or offload=none.",
            key="offload.device", value=device.value))
    if params and stage != 3:
        out.append(UserError(
            f"offload.params=true with zero.stage={stage}: only ZeRO-3 partitions parameters, so only it can "
            "offload them.", "zero=stage3, or offload.params=false (optimizer states still offload).",
            key="offload.params", value=True))
    if params and device == OffloadDevice.none:
        out.append(UserError("offload.params=true with offload=none: nowhere to offload to.",
                             "offload=cpu or offload=nvme.", key="offload.params", value=True))
    if device == OffloadDevice.nvme and stage != 3:
        out.append(UserError(
            f"offload=nvme with zero.stage={stage}: DeepSpeed's NVMe offload (ZeRO-Infinity) needs ZeRO-3.",
            "zero=stage3, or offload=cpu.", key="offload.device", value="nvme"))
    return out


def pipeline_problems(stage: int) -> List[UserError]:
    """DeepSpeed's rule for pipelines: ZeRO-0/1 only."""
    if stage < 2:
        return []
    return [UserError(
        f"parallel=pipeline with zero.stage={stage}: DeepSpeed refuses ZeRO-2 and ZeRO-3 with pipeline "
        "parallelism (they partition gradients/parameters across the pipeline's data-parallel groups).",
        "zero=stage1 or zero=stage0, or parallel=dp.", key="zero.stage", value=stage)]


def adapter_problems(adapter: AdapterName, stage: int, mode: ParallelMode) -> List[UserError]:
    """What zerorun trains with LoRA: ZeRO-0/1/2 with data parallelism. ZeRO-3 gathers and exports peft's module
    names, and pipeline stages wrap the plain HF modules: neither has been run with adapters (a frozen base is
    small enough that ZeRO-2 rarely needs more). Tensor parallelism: DeepSpeed 0.19.8's AutoTP replaces the
    parameters of peft's wrapped projections, and ZeRO's optimizer then fails in deepspeed.initialize (KeyError in
    stage_1_and_2.py ``_create_param_mapping``, tried on a tiny Llama with LoRA on q/v, ZeRO-1, 2 ranks)."""
    name = AdapterName(adapter)
    if not name.adapts or (stage < 3 and ParallelMode(mode) == ParallelMode.dp):
        return []
    if ParallelMode(mode) == ParallelMode.tp:
        return [UserError(f"adapter={name.value} with parallel=tp: DeepSpeed 0.19.8's AutoTP cannot shard peft's "
                          "LoRA-wrapped projections (deepspeed.initialize fails).", "parallel=dp with zero=stage2 (a "
                          "frozen base is small), or adapter=none to train the whole model with parallel=tp.",
                          key="adapter.name", value=name.value)]
    what = "zero=stage3" if stage == 3 else "parallel=pipeline"
    why = (" (ZeRO-3 would partition bitsandbytes' packed 4-bit weights, which it cannot gather back)"
           if name == AdapterName.qlora and stage == 3 else "")
    return [UserError(f"adapter={name.value} with {what}: zerorun trains adapters with ZeRO-0/1/2 and data "
                      f"parallelism{why} (a frozen base is small enough that ZeRO-2 rarely needs more).",
                      "zero=stage2 (or zero=stage1) with parallel=dp, with offload=cpu if the states still do not fit.",
                      key="adapter.name", value=name.value)]


def qlora_problems(adapter) -> List[UserError]:
    """QLoRA needs bitsandbytes (the optional ``8bit`` extra), and its 4-bit base cannot take a merged update."""
    import importlib.util

    if AdapterName(adapter.name) != AdapterName.qlora:
        return []
    out = []
    if importlib.util.find_spec("bitsandbytes") is None:
        out.append(UserError("adapter=qlora needs bitsandbytes (4-bit NF4 weights), which is not installed.",
                             "pip install 'zerorun[8bit]' (bitsandbytes==0.50.2), or adapter=lora.",
                             key="adapter.name", value="qlora"))
    if adapter.merge:
        out.append(UserError("adapter.merge=true with adapter=qlora: merging into the 4-bit base would round the "
                             "update away, and a dequantized merge is not the model that trained.",
                             "adapter.merge=false (the adapter exports to export/adapter/; merge it into the 16-bit "
                             "base with peft's merge_and_unload), or adapter=lora.", key="adapter.merge", value=True))
    return out


def tp_problems(m, tp_size: int, world_size: int, offload: OffloadDevice) -> List[UserError]:
    """What parallel=tp needs: a family AutoTP shards and zerorun has trained with it, a tp_size that fits its
    key/value heads (zerorun/arch ``tp_problems``) and divides the world, and no offload (not run with AutoTP here)."""
    from ..arch import tp_problems as arch_problems

    tp = max(1, tp_size)
    out = [UserError(what, fix, key=key, value=value) for what, fix, key, value in arch_problems(m, tp)]
    if world_size % tp:
        out.append(UserError(f"parallel.tp_size={tp} does not divide the world size {world_size}: every rank "
                             "belongs to one tensor-parallel group.", f"launcher.nproc_per_node × launcher.nnodes a "
                             f"multiple of {tp}, or another parallel.tp_size.", key="parallel.tp_size", value=tp))
    if OffloadDevice(offload) != OffloadDevice.none:
        out.append(UserError(f"offload={OffloadDevice(offload).value} with parallel=tp: zerorun has not run "
                             "DeepSpeed's offload with AutoTP.", "offload=none (tensor parallelism already divides "
                             "the states by parallel.tp_size), or parallel=dp with offload.",
                             key="offload.device", value=OffloadDevice(offload).value))
    return out


def fused_loss_problems(cfg, stage: Optional[int] = None) -> List[UserError]:
    """Where ``trainer.fused_loss`` runs (zerorun.train.fused_loss): a causal LM trained with data parallelism at
    ZeRO-0/1/2, whose loss is the cross-entropy of a plain Linear head on the last hidden state. ZeRO-3 partitions
    the head's weight outside its module's forward; a pipeline's last stage and AutoTP's sharded head compute the
    loss in their own modules; a LoRA head is no plain Linear; an MoE model asked for its router loss
    (output_router_logits) adds a term the fused loss does not compute. ``stage``: at that ZeRO stage instead of the
    config's."""
    P, key, out = UserError, "trainer.fused_loss", []
    task, mode, m, adapter = resolve_task(cfg.task.name, cfg.model.family), cfg.parallel.mode, cfg.model, cfg.adapter
    stage = cfg.zero.stage if stage is None else stage
    if TaskName(task) != TaskName.causal_lm:
        out.append(P(f"trainer.fused_loss=true with task={TaskName(task).value}: it fuses a causal LM's head and "
                     "loss; a classifier has no vocabulary-wide logits.", "drop trainer.fused_loss.", key=key,
                     value=True))
    elif stage == 3 or ParallelMode(mode) != ParallelMode.dp:
        what = "zero=stage3" if stage == 3 else f"parallel={ParallelMode(mode).value}"
        out.append(P(f"trainer.fused_loss=true with {what}: the fused loss reads the head's whole weight, which "
                     f"{what} keeps partitioned or sharded outside the head's own forward.",
                     "zero=stage2 (or 0/1) with parallel=dp, or drop trainer.fused_loss.", key=key, value=True))
    if AdapterName(adapter.name).adapts and "lm_head" in (adapter.target_modules or []):
        out.append(P("trainer.fused_loss=true with lm_head among adapter.target_modules: the fused loss uses the "
                     "head's own weight, not an adapter on it.", "leave lm_head out of adapter.target_modules, or "
                     "drop trainer.fused_loss.", key=key, value=True))
    from ..arch import hf_fields

    if hf_fields(m).get("output_router_logits"):
        out.append(P("trainer.fused_loss=true with output_router_logits=true: the router's load-balancing loss is "
                     "not computed by the fused loss.", "drop trainer.fused_loss, or output_router_logits.", key=key,
                     value=True))
    return out


def fused_loss_runs(cfg, stage: Optional[int] = None) -> bool:
    """Whether ``trainer.fused_loss`` can run with ``cfg`` at ZeRO ``stage`` (default the config's)."""
    return not fused_loss_problems(cfg, stage)


def fused_loss_on(cfg, accelerator: str, stage: Optional[int] = None) -> bool:
    """``trainer.fused_loss`` as a run takes it (at ZeRO ``stage``, default the config's): true or false as set;
    null: on for a CPU rank's causal LM wherever it runs (measured there: 3% faster, 20% less resident memory and a
    tighter estimate than the model's own loss, docs/memory.md §3.5), off on GPUs until it is measured there
    (gate=autofit may turn it on)."""
    if cfg.trainer.fused_loss is not None:
        return bool(cfg.trainer.fused_loss)
    return accelerator == "cpu" and fused_loss_runs(cfg, stage)


def lora_target_problems(m, adapter) -> List[UserError]:
    """LoRA's target modules against the model's linear layers (zerorun/arch), before anything launches."""
    from ..arch import lora_target_problems as arch_problems

    return [UserError(what, fix, key=key, value=value) for what, fix, key, value in arch_problems(m, adapter)]


def layouts(mode: ParallelMode = ParallelMode.dp, adapter: AdapterName = AdapterName.none) -> List[Layout]:
    """Every layout zerorun offers for ``mode`` (and ``adapter``), in table order: those the rules above accept,
    and for a pipeline or tensor parallelism no offload (DeepSpeed allows it, but zerorun has not tested it)."""
    out = []
    for stage in range(4):
        for device in OffloadDevice:
            for params in (False, True):
                if offload_problems(stage, device, params) or (params and stage < 3) \
                        or adapter_problems(adapter, stage, mode):
                    continue
                if ParallelMode(mode) == ParallelMode.pipeline and (pipeline_problems(stage)
                                                                   or device != OffloadDevice.none):
                    continue
                if ParallelMode(mode) == ParallelMode.tp and device != OffloadDevice.none:
                    continue
                out.append(Layout(stage, device, params))
    return out


# ---------------------------------------------------------------------------------------------
# Model family → task → built-in data set


def default_task(family: Family) -> TaskName:
    """task=auto: causal LM for the decoders, sequence classification for the encoders (zerorun/arch)."""
    from ..arch import default_task as arch_default

    return TaskName(arch_default(family))


def resolve_task(task: TaskName, family: Family) -> TaskName:
    return default_task(family) if TaskName(task) == TaskName.auto else TaskName(task)


def task_problems(task: TaskName, family: Family, model_name: str, num_labels: int) -> List[UserError]:
    from ..arch import families, traits

    decoder = traits(family).decoder
    out = []
    if task == TaskName.causal_lm and not decoder:
        out.append(UserError(f"task=causal_lm with model {model_name} (family {Family(family).value}): encoders are "
                             "not causal LMs here.", f"task=sequence_classification, or a model of a decoder family "
                             f"({', '.join(families(decoder=True))}).", key="task"))
    if task == TaskName.sequence_classification and decoder:
        out.append(UserError(f"task=sequence_classification with model {model_name}: zerorun classifies with the "
                             f"encoder families ({', '.join(families(decoder=False))}).", "a model of those "
                             "families (conf/model/), or task=causal_lm.", key="task"))
    if task == TaskName.sequence_classification and num_labels < 2:
        out.append(UserError(f"task.num_labels={num_labels}: classification needs at least 2 labels.",
                             key="task.num_labels", value=num_labels))
    return out


def shape_problems(m, pipeline: bool) -> List[UserError]:
    """Shapes the model's family cannot build, or a pipeline it has no layers for (zerorun/arch)."""
    from ..arch import shape_problems as arch_problems

    return [UserError(what, fix, key=key, value=value) for what, fix, key, value in arch_problems(m, pipeline)]


BUILTIN_DATASETS = {TaskName.causal_lm: "synthetic", TaskName.sequence_classification: "sentiment"}
"""data.name=auto: the built-in set that fits the task (both made by zerorun, offline)."""


# ---------------------------------------------------------------------------------------------
# The optimizer implementation each layout gets


class OptimizerImpl(str, enum.Enum):
    fused_adam = "fused_adam"  # DeepSpeed's FusedAdam: GPU ranks, states on the GPU
    cpu_adam = "cpu_adam"  # DeepSpeedCPUAdam: optimizer offload, steps on the host
    torch_adamw = "torch_adamw"  # torch.optim.AdamW: CPU ranks (FusedAdam's CPU build is a JIT compile)
    bnb_adamw8bit = "bnb_adamw8bit"  # bitsandbytes AdamW8bit, a client optimizer (zerorun builds it)
    torch_sgd = "torch_sgd"  # torch.optim.SGD, a client optimizer

    @property
    def client(self) -> bool:
        """zerorun builds it and hands it to deepspeed.initialize (no ds_config optimizer section)."""
        return self in (OptimizerImpl.bnb_adamw8bit, OptimizerImpl.torch_sgd)


def optimizer_impl(accelerator: str, offload_optimizer: bool, name: OptimizerName = OptimizerName.adamw
                   ) -> OptimizerImpl:
    name = OptimizerName(name)
    if name == OptimizerName.adamw8bit:
        return OptimizerImpl.bnb_adamw8bit
    if name == OptimizerName.sgd:
        return OptimizerImpl.torch_sgd
    if offload_optimizer:
        return OptimizerImpl.cpu_adam
    return OptimizerImpl.torch_adamw if accelerator == "cpu" else OptimizerImpl.fused_adam


def optimizer_problems(name: OptimizerName, device: OffloadDevice, pipeline: bool) -> List[UserError]:
    """What each optimizer cannot do under DeepSpeed."""
    name, device = OptimizerName(name), OffloadDevice(device)
    out = []
    if name != OptimizerName.adamw and device == OffloadDevice.nvme:
        out.append(UserError(
            f"optimizer={name.value} with offload=nvme: DeepSpeed's NVMe optimizer swap moves its own Adam's fp32 "
            "states only.", f"offload=cpu (optimizer.{name.value} steps on the host), or optimizer=adamw.",
            key="optimizer.name", value=name.value))
    if name != OptimizerName.adamw and pipeline:
        out.append(UserError(
            f"optimizer={name.value} with parallel=pipeline: zerorun hands client optimizers to data-parallel "
            "engines only.", "parallel=dp, or optimizer=adamw.", key="optimizer.name", value=name.value))
    if name == OptimizerName.adamw8bit:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            out.append(UserError("optimizer=adamw8bit needs bitsandbytes, which is not installed.",
                                 "pip install 'zerorun[8bit]' (bitsandbytes==0.50.2), or optimizer=adamw.",
                                 key="optimizer.name", value=name.value))
    return out


# ---------------------------------------------------------------------------------------------
# How CPU ranks allocate

CPU_MMAP_THRESHOLD = 1 << 20
"""The memory-saving mmap threshold (``launcher.mmap_threshold_mib=1``): what the RSS estimate is validated
at, and what an unresolved (auto) setting is estimated with."""
FAST_MMAP_THRESHOLD_MIB = 32
"""glibc's own ceiling for its dynamic threshold: activations stay on the heap, but a tensor above 32 MiB
(GPT-2's logits and their gradient) still gets its own mapping and is page-faulted anew every step."""
MMAP_OFF_MIB = 0
"""``launcher.mmap_threshold_mib=0``: no block gets its own mapping and the heap is never trimmed
(MALLOC_MMAP_MAX_=0): every freed block, the logits too, is reused by the next step. The fastest (1.09x the
glibc default for the hand-written loop on GPT-2 4 × 256: 4x fewer page faults) and the most resident."""
MMAP_OFF_BYTES = 1 << 62
"""The threshold the estimates see for ``mmap_threshold_mib=0``: every tensor is below it, on the heap."""


def mmap_threshold_bytes(mib) -> int:
    """``launcher.mmap_threshold_mib`` in bytes; 0 (mmap off) is MMAP_OFF_BYTES; auto (None) until the gate
    resolves it counts as 1 MiB."""
    if mib == MMAP_OFF_MIB:
        return MMAP_OFF_BYTES
    return (mib or 1) << 20

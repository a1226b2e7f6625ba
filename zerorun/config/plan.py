"""The resolved plan: everything a config implies on a given world, computed once.

The launcher makes it, renders the DeepSpeed JSON from it, estimates memory with it and writes it
to the run dir as ``plan.json``; ranks read it back instead of deriving anything again.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

from ..arch import count_params
from .rules import OptimizerImpl, fused_loss_on, optimizer_impl, params_offloaded, resolve_task
from .schema import Dtype, OffloadDevice, ParallelMode, RunConfig, TaskName


@dataclass(frozen=True)
class World:
    """How many ranks the run has: decided by the launcher config and the machine."""

    nproc_per_node: int
    nnodes: int
    accelerator: str  # "cuda" or "cpu"
    fp16_ok: bool = True  # whether the ranks' device can train in fp16

    @property
    def size(self) -> int:
        return self.nproc_per_node * self.nnodes


def plan_world(cfg: RunConfig, hw: Any, nodes: Optional[int] = None) -> World:
    """The ranks a run has on hardware ``hw`` (a zerorun.hardware.Hardware): launcher.nproc_per_node,
    else one per GPU, else min(2, cores) CPU ranks. Nodes: ``nodes``, else hardware.nodes (planning),
    else launcher.nnodes."""
    nproc = cfg.launcher.nproc_per_node
    if nproc is None:
        nproc = hw.gpus_per_node if hw.accelerator == "cuda" else max(1, min(2, hw.cpu_cores))
    if nodes is None:
        nodes = cfg.hardware.nodes if cfg.hardware.nodes is not None else cfg.launcher.nnodes
    return World(nproc_per_node=nproc, nnodes=nodes, accelerator=hw.accelerator, fp16_ok=hw.fp16_ok)


# ---------------------------------------------------------------------------------------------
# Batch geometry: the one place these numbers are derived


def tensor_parallel_size(cfg: RunConfig) -> int:
    """Ranks that share each layer's weights (parallel=tp); 1 otherwise."""
    return max(1, cfg.parallel.tp_size) if cfg.parallel.mode == ParallelMode.tp else 1


def data_parallel_size(cfg: RunConfig, world: World) -> int:
    if cfg.parallel.mode == ParallelMode.pipeline:
        return max(1, world.size // max(1, cfg.parallel.stages))
    return max(1, world.size // tensor_parallel_size(cfg))


def global_batch(cfg: RunConfig, world: World) -> int:
    """Sequences per optimizer step over all ranks. A pipeline's parallel.micro_batches, when set,
    is the accumulation count (DeepSpeed's pipeline streams that many micro-batches per step)."""
    if cfg.trainer.global_batch_size:
        return cfg.trainer.global_batch_size
    pipeline = cfg.parallel.mode == ParallelMode.pipeline
    accum = cfg.parallel.micro_batches if pipeline and cfg.parallel.micro_batches else 1
    return cfg.trainer.micro_batch_size * accum * data_parallel_size(cfg, world)


def grad_accum_steps(cfg: RunConfig, world: World) -> int:
    per_step = cfg.trainer.micro_batch_size * data_parallel_size(cfg, world)
    return max(1, global_batch(cfg, world) // max(1, per_step))


DDP_BUCKET_BYTES = 25 * 2**20
"""torch DDP's bucket_cap_mb: the gradient bytes one collective carries by default."""


@dataclass(frozen=True)
class Buckets:
    """ZeRO bucket sizes in elements: the user's, else ``bucket_sizes``'s.

    Every bucket is one collective, and a collective has a fixed cost (~2 ms inside DeepSpeed on a CPU rank,
    tens of µs with NCCL), so few large buckets are faster; but DeepSpeed allocates the reduce bucket whole
    (twice with overlap_comm), so its own default of 5e8 elements is ~1 GiB of 16-bit buffer, more than GPT-2
    small's model states; HF's "auto" (hidden²) costs ~150 collectives per micro-batch for GPT-2 small. zerorun
    takes DDP's 25 MiB of gradients, capped at the model's size (a small model reduces in one collective per
    micro-batch); autofit's "smaller buckets" rung goes down to hidden² (``small_bucket_sizes``) when the
    memory is needed. The memory estimate follows DeepSpeed at either size (memory/buffers.py FirstReduce)."""

    reduce_bucket_size: int
    allgather_bucket_size: int
    stage3_prefetch_bucket_size: int
    stage3_param_persistence_threshold: int

    def to_json(self) -> Dict[str, int]:
        return asdict(self)


def _model_params(cfg: RunConfig) -> int:
    return count_params(cfg.model, resolve_task(cfg.task.name, cfg.model.family), cfg.task.num_labels)


def bucket_sizes(cfg: RunConfig) -> Buckets:
    h, z = cfg.model.hidden_size, cfg.zero
    grad_bytes = 4 if Dtype(cfg.precision.dtype) == Dtype.fp32 else 2
    # A multiple of 64: stage_1_and_2.py asserts allgather_bucket_size % nccl_start_alignment_factor == 0.
    fast = -(-min(DDP_BUCKET_BYTES // grad_bytes, _model_params(cfg)) // 64) * 64
    return Buckets(
        reduce_bucket_size=z.reduce_bucket_size or fast,
        allgather_bucket_size=z.allgather_bucket_size or fast,
        stage3_prefetch_bucket_size=z.stage3_prefetch_bucket_size or int(0.9 * h * h),
        stage3_param_persistence_threshold=(z.stage3_param_persistence_threshold
                                            if z.stage3_param_persistence_threshold is not None else 10 * h),
    )


def small_bucket_sizes(cfg: RunConfig) -> Dict[str, int]:
    """The ``zero.*`` bucket settings of autofit's "smaller buckets" rung: hidden² (HF's "auto"), the least
    memory that still reduces a layer in a few collectives."""
    h = cfg.model.hidden_size
    return {"reduce_bucket_size": h * h, "allgather_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h)}


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Plan:
    world: World
    task: TaskName
    data_parallel_size: int
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    seq_len: int
    pipeline: bool
    pipeline_stages: int
    """1 without a pipeline."""
    buckets: Buckets
    offload_optimizer: bool
    offload_params: bool
    optimizer: OptimizerImpl
    nvme_path: str
    """Where NVMe offload swaps ("" when not offloading to NVMe or not yet placed in a run dir)."""
    tensor_parallel: int = 1
    """Ranks of one tensor-parallel group (parallel=tp: DeepSpeed AutoTP's autotp_size); 1 without."""
    fused_loss: bool = False
    """Whether the ranks take the fused loss (``trainer.fused_loss`` resolved: rules.fused_loss_on)."""

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def to_json(self) -> Dict[str, Any]:
        d = asdict(self)
        d["task"], d["optimizer"] = self.task.value, self.optimizer.value
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Plan":
        d = dict(d, world=World(**d["world"]), buckets=Buckets(**d["buckets"]), task=TaskName(d["task"]),
                 optimizer=OptimizerImpl(d["optimizer"]))
        return cls(**d)


def make_plan(cfg: RunConfig, world: World, longest: int = 0) -> Plan:
    """The plan of ``cfg`` on ``world``. Pure; assumes ``check`` found nothing (it does not crash otherwise).

    ``longest``: the data's longest example in tokens, when known (classification pads each batch to its own
    longest row, so no batch is longer): the plan's ``seq_len`` is then the longest batch the data can make, not
    ``data.seq_len``. A review set of 10-token examples under ``data.seq_len=128`` was estimated at 128 tokens
    per row: +31% of MiniLM's peak RSS."""
    off = OffloadDevice(cfg.offload.device)
    offload_optimizer = cfg.zero.stage >= 1 and off != OffloadDevice.none
    pipeline = cfg.parallel.mode == ParallelMode.pipeline
    task = resolve_task(cfg.task.name, cfg.model.family)
    padded = task != TaskName.causal_lm and longest > 0
    return Plan(
        world=world,
        task=task,
        data_parallel_size=data_parallel_size(cfg, world),
        micro_batch_size=cfg.trainer.micro_batch_size,
        grad_accum_steps=grad_accum_steps(cfg, world),
        global_batch_size=global_batch(cfg, world),
        seq_len=min(cfg.data.seq_len, longest) if padded else cfg.data.seq_len,
        pipeline=pipeline,
        pipeline_stages=max(1, cfg.parallel.stages) if pipeline else 1,
        buckets=bucket_sizes(cfg),
        offload_optimizer=offload_optimizer,
        offload_params=params_offloaded(cfg.zero.stage, off, cfg.offload.params),
        optimizer=optimizer_impl(world.accelerator, offload_optimizer, cfg.optimizer.name),
        nvme_path=cfg.offload.nvme_path if off == OffloadDevice.nvme else "",
        tensor_parallel=tensor_parallel_size(cfg),
        fused_loss=fused_loss_on(cfg, world.accelerator),
    )

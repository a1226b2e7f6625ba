"""§2 Model states: where each byte of parameters, gradients, fp32 masters and optimizer states lives.

docs/memory.md §2. The ZeRO paper's 2Ψ + 2Ψ + KΨ partitioned per stage (§2.1), corrected to what
DeepSpeed 0.19.8 really allocates (§2.2; the source file of each term is named next to it), and split
by place: the device (GPU, or host RAM on CPU ranks), pinned host RAM (offload) and NVMe.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, List, Tuple

from ..config import Dtype, OffloadDevice, OptimizerImpl, Plan, RunConfig
from .activations import DTYPE_BYTES
from .params import ParamBreakdown

MASTER_BYTES = 4
QLORA_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per 4-bit NF4 weight with double quantization (bitsandbytes, block 64): half a byte, its block's absmax
quantized to 8 bits (1/64), and one fp32 scale per 256 absmax blocks (QLoRA, Dettmers et al. 2023: 0.127 bits)."""
"""fp32 master copy per parameter (§2.1: the 4Ψ of K=12). DeepSpeed ZeRO-1/2/3 clone it even in
fp32 training (stage_1_and_2.py: ``weights_partition = ....clone().to(master dtype)``; stage3.py
``_create_fp32_partitions``: ``converted.clone()``), so it exists for every ZeRO stage ≥ 1."""

ADAM_STATE_BYTES = 8
"""Adam momentum + variance in fp32 per parameter (§2.1: the 8Ψ of K=12)."""

BNB_BLOCK = 256
"""bitsandbytes' 8-bit optimizers quantize states in blocks of 256 with one fp32 absmax per block per state
(functional.py, backends/cpu/ops.py ``blocksize = 256``): 2 + 2 × 4/256 bytes per parameter for AdamW8bit."""

BNB_CPU_STEP_BYTES = 20
"""bitsandbytes' CPU step (backends/cpu/ops.py ``_optimizer_update_8bit_blockwise_cpu``) dequantizes both
states to fp32, makes an fp32 grad and the denominator, then quantizes back: 20 bytes per element of the
tensor it updates (measured, peak RSS over the second step of an 8M-element tensor, fp32 and bf16 grads).
The CUDA kernel updates in place: none."""

DS_SUB_GROUP_SIZE = 1_000_000_000
"""ZeRO-3 ``sub_group_size`` default (deepspeed/runtime/zero/config.py); zerorun does not set it."""

NVME_PARAM_BUFFERS = (5, 100_000_000)
"""ZeRO-3 NVMe parameter swap: ``buffer_count`` × ``buffer_size`` elements of pinned host memory
(deepspeed/runtime/zero/offload_config.py defaults; partitioned_param_swapper.py allocates them)."""

MIN_AIO_BYTES = 2**20
"""A ZeRO-3 partition smaller than this (and than aio.block_size, 1 MiB in zerorun's JSON) is not swapped to NVMe
(deepspeed/runtime/swap_tensor/utils.py MIN_AIO_BYTES)."""

NVME_OPTIMIZER_BUFFERS = 4
"""NVMe optimizer swap: ``buffer_count`` pinned fp32 buffers of the largest sub-group
(offload_config.py default 4; optimizer_utils.py SwapBufferManager)."""


def trainable_tensors(bd: ParamBreakdown) -> Tuple[int, ...]:
    """The element counts of the tensors that get gradients: every one, or LoRA's adapters and a trained head."""
    if not bd.lora:
        return bd.tensors()
    return (*bd.adapter_tensors * bd.num_layers, *bd.trainable_head)


def pinned_resident(nbytes: float) -> int:
    """Host RAM a page-locked buffer of ``nbytes`` holds on a GPU rank: PyTorch's CUDA host allocator
    (ATen/core/CachingHostAllocator.h ``allocate``) rounds every block up to the next power of two (its default
    ``pinned_max_round_threshold`` is unlimited), and page-locked memory is resident in full. A freed block stays
    in the allocator's cache for reuse, never returned to the system (measured on an H200, docs/memory.md §8.6)."""
    n = int(math.ceil(nbytes))
    return 1 << (n - 1).bit_length() if n > 0 else 0


def pinned_total(sizes: Iterable[float]) -> int:
    """``pinned_resident`` summed over many blocks, once per distinct size (a model repeats its layers' shapes)."""
    return sum(pinned_resident(n) * count for n, count in Counter(sizes).items())


PINNED_CACHE = "pinned partitions, freed to the host cache"
"""ZeRO-3 parameter offload on a GPU rank: the partitions pinned one by one before they moved to the flat buffer."""

STATE_NAMES = ("parameters", "persistent parameters", "gradients", "fp32 master copies", "optimizer states")
"""The device entries that are model states (ZeRO §2.1); the rest of a phase is buffers and activations."""


def phase(items: Iterable[Tuple[str, float]]) -> "OrderedDict[str, int]":
    """A named breakdown: entries with the same name add up, zero entries drop out."""
    out: "OrderedDict[str, int]" = OrderedDict()
    for k, v in items:
        v = int(v)
        if v > 0:
            out[k] = out.get(k, 0) + v
    return out


@dataclass
class ModelStates:
    """Bytes by name on one rank: on its device through every phase, in host RAM, on NVMe."""

    device: "OrderedDict[str, int]"
    host: List[Tuple[str, float]] = field(default_factory=list)
    nvme: int = 0
    partition: int = 0
    """Elements of this rank's ZeRO partition (DeepSpeed pads to equal partitions)."""

    @property
    def model_state_bytes(self) -> int:
        return sum(v for k, v in self.device.items() if k in STATE_NAMES)


def optimizer_state_bytes(cfg: RunConfig, plan: Plan, elements: int, small: int = 0) -> int:
    """The optimizer's states for ``elements`` parameters, ``small`` of them in tensors below AdamW8bit's
    ``min_8bit_size`` (fp32 states). Under ZeRO the optimizer sees one flat partition: ``small`` = 0 and the
    partition itself is the tensor."""
    if plan.optimizer == OptimizerImpl.bnb_adamw8bit:
        if elements < cfg.optimizer.min_8bit_size:
            return elements * ADAM_STATE_BYTES
        big = elements - small
        return small * ADAM_STATE_BYTES + 2 * big + 2 * 4 * math.ceil(big / BNB_BLOCK) + 2 * 256 * 4  # + qmaps
    if plan.optimizer == OptimizerImpl.torch_sgd:
        return elements * 4 if cfg.optimizer.momentum else 0
    return elements * ADAM_STATE_BYTES


def optimizer_step_bytes(plan: Plan, tensor: int) -> int:
    """Temporaries of the optimizer's own step over its largest tensor (a flat partition under ZeRO), where
    it steps on the rank's device."""
    if plan.optimizer == OptimizerImpl.torch_adamw:
        return 2 * 4 * tensor  # for-loop AdamW: ``exp_avg_sq.sqrt() / bc2`` then ``.add_``
    if plan.optimizer == OptimizerImpl.bnb_adamw8bit and plan.world.accelerator == "cpu":
        return BNB_CPU_STEP_BYTES * tensor
    if plan.optimizer == OptimizerImpl.torch_sgd:
        return 4 * tensor  # ``grad.add(param, alpha=weight_decay)`` (foreach on CUDA: a copy of every grad)
    return 0


def optimizer_swapped(cfg: RunConfig, plan: Plan) -> bool:
    """ZeRO-Infinity: ZeRO-3 keeps the optimizer's states on NVMe and swaps them through pinned host buffers."""
    return plan.offload_optimizer and cfg.zero.stage == 3 and OffloadDevice(cfg.offload.device) == OffloadDevice.nvme


def host_step_bytes(cfg: RunConfig, plan: Plan, tensor: int) -> int:
    """With optimizer offload, a client optimizer steps on the host's fp32 partition (DeepSpeedCPUAdam:
    in place). Swapped to NVMe (ZeRO-Infinity) the optimizer builds its states lazily on the first step, in
    ordinary host memory (cpu_adam.py ``torch.zeros_like``), before the swapper writes them out: the states of one
    sub-group on top of the pinned swap buffers, once (measured: GPT-2 small fp32 on one rank, 950 MiB above the
    step's steady state inside ``cpu_adam.step``, = Adam's two fp32 states of its 124M-element partition)."""
    first_states = optimizer_state_bytes(cfg, plan, tensor) if optimizer_swapped(cfg, plan) else 0
    # ZeRO-3 on a GPU writes the stepped fp32 sub-group into the device's 16-bit partition with one ``copy_``
    # (stage3.py ``_reassign_or_swap_out_partitioned_parameters``); a host-to-device copy that changes dtype
    # converts on the host first (ATen/native/cuda/Copy.cu ``copy_kernel_cuda``: ``src.to(dst.dtype)``).
    to_device = plan.world.accelerator == "cuda" and cfg.zero.stage == 3 and not plan.offload_params
    dtype = Dtype(cfg.precision.dtype)
    convert = tensor * DTYPE_BYTES[dtype] if to_device and dtype != Dtype.fp32 else 0
    if plan.optimizer == OptimizerImpl.bnb_adamw8bit:
        return first_states + convert + BNB_CPU_STEP_BYTES * tensor
    return first_states + convert + (4 * tensor if plan.optimizer == OptimizerImpl.torch_sgd else 0)


def param_swap_element_bytes(dtype: Dtype, fp16_supported: bool) -> int:
    """Bytes per element of ZeRO-3's NVMe parameter swap buffers. zero.Init picks their dtype with
    ``dtype or torch.float16 if <fp16 supported> else torch.bfloat16 if <a method, always true> else torch.float32``
    (partition_parameters.py ``_set_dtype``): where fp16 is not supported (most CPUs) they are bf16 whatever the
    model's dtype (measured: 1e9 bytes for 5 × 1e8 elements in an fp32 run on CPU ranks)."""
    return DTYPE_BYTES[dtype] if fp16_supported else 2


def model_states(cfg: RunConfig, plan: Plan, bd: ParamBreakdown, swap_element_bytes: int = 0) -> ModelStates:
    """Where the model states of ``bd`` live for the config's ZeRO stage, precision and offload
    (``swap_element_bytes``: param_swap_element_bytes on the ranks' hardware; 0: the module's dtype)."""
    dtype = Dtype(cfg.precision.dtype)
    # P: every parameter (the module holds them); T: the trainable ones (all, or LoRA's adapters): only those
    # get gradients, fp32 master copies and optimizer states.
    P, T, N, stage = bd.total, bd.trainable, max(1, plan.data_parallel_size), cfg.zero.stage
    p = g = DTYPE_BYTES[dtype]  # 16-bit or fp32 module: params and grads in that dtype
    swap_element_bytes = swap_element_bytes or p
    mixed = dtype != Dtype.fp32
    off = OffloadDevice(cfg.offload.device)
    off_opt, off_param = plan.offload_optimizer, plan.offload_params
    part, tpart = math.ceil(P / N), math.ceil(T / N)
    # What DeepSpeed page-locks (offload.pin_memory) on a GPU rank is resident in power-of-two blocks
    pinning = cfg.offload.pin_memory and plan.world.accelerator == "cuda"
    pin = pinned_resident if pinning else (lambda n: n)
    dev: List[Tuple[str, float]] = []
    host: List[Tuple[str, float]] = []  # per rank
    nvme = 0
    if bd.quantized:  # QLoRA: the layers' linear weights in 4 bits, the rest (embeddings, norms, head) in dtype
        dev.append(("parameters", (P - bd.quantized) * p + bd.quantized * QLORA_BYTES))
    elif stage < 3:
        dev.append(("parameters", P * p))
    else:
        persistent = bd.persistent(plan.buckets.stage3_param_persistence_threshold)
        # stage3.py: partitioned 16-bit flat buffer (on host with offload_param) + persistent params whole
        if off_param:
            host.append(("parameters (host)", pin(part * p)))  # the flat buffer (stage3.py, pinned)
            # partition_parameters.py pins each partition as DeepSpeed partitions the module; stage3.py then
            # moves them into the flat buffer, and the freed blocks stay in the host allocator's cache.
            threshold = plan.buckets.stage3_param_persistence_threshold
            cached = pinned_total((math.ceil(t / N) * p for t in bd.tensors() if t > threshold)) if pinning else 0
            host.append((PINNED_CACHE, cached))
        else:
            dev.append(("parameters", part * p))
        dev.append(("persistent parameters", persistent * p))
    dev.append(("buffers", bd.buffer_bytes))

    states = [("fp32 master copies", tpart * MASTER_BYTES),
              ("optimizer states", optimizer_state_bytes(cfg, plan, tpart))]
    if bf16_optimizer_pipeline(cfg, plan):
        # A bf16 pipeline at ZeRO-0 gets BF16_Optimizer (engine.py _do_optimizer_sanity_check): the 16-bit
        # param.grad stay next to a flat accumulation buffer in grad_accum_dtype (bf16 by default), and the
        # fp32 master and Adam states are partitioned over the stage's data-parallel group (measured).
        dev.append(("gradients", 2 * T * g))
        dev += states
    elif stage == 0:
        dev.append(("gradients", T * g))
        if mixed:  # FP16_Optimizer / FP16_UnfusedOptimizer: fp32 master of every parameter
            dev.append(("fp32 master copies", T * MASTER_BYTES))
        # The optimizer sees each tensor: AdamW8bit keeps fp32 states for the small ones.
        small = bd.persistent(cfg.optimizer.min_8bit_size - 1) if plan.optimizer.client and not bd.lora else 0
        dev.append(("optimizer states", optimizer_state_bytes(cfg, plan, T, small)))
    elif stage in (1, 2):
        if stage == 1:
            # stage_1_and_2.py: param.grad full until the boundary reduce, + grads_in_partition. A pipeline reduces
            # once, after the step's last backward (PipelineEngine _exec_reduce_grads), and the partition is
            # released with the bucket at its end: it lives only into the step (phases.step_phases).
            dev.append(("gradients", T * g + (0 if off_opt or plan.pipeline else tpart * g)))
        elif not off_opt:
            dev.append(("gradients", tpart * g))  # grads_in_partition (``copy_grads_in_partition``)
        if off_opt:
            # Offload: pinned fp32 master + fp32 grad partition + 16-bit staging; CPU Adam states (not pinned).
            host += [("fp32 master copies (host)", pin(tpart * MASTER_BYTES)),
                     ("optimizer states (host)", optimizer_state_bytes(cfg, plan, tpart))]
            host.append(("fp32 gradients (host)", pin(tpart * 4)))
            host.append(("16-bit param staging (host)", pin(tpart * p)))
            host.append(("grad staging buffer (host)", pin(bd.largest_trainable * g)))
            if plan.grad_accum_steps > 1:  # one pinned buffer per parameter (``buffer_to_accumulate_to_in_cpu``)
                accumulated = pinned_total(t * g for t in trainable_tensors(bd)) / N if pinning else tpart * g
                host.append(("accumulated gradients (host)", accumulated))
            dev.append(("offload staging buffer", bd.largest_trainable * g))  # temp_grad_buffer_for_gpu_offload
        else:
            dev += states
    else:  # stage 3
        grad_buf = [("gradients", tpart * g)]  # grad_partitions_flat_buffer (on self.device)
        if off_opt:
            # With offload the fp32 grad of each sub-group is a persistent pinned buffer
            # (stage3.py initialize_optimizer_states: subgroup_gradient_buffer); without, a step transient.
            # pinned: the 16-bit grad partitions' flat buffer and each sub-group's fp32 grad; not: master, states
            subs = [min(DS_SUB_GROUP_SIZE, tpart - i) for i in range(0, tpart, DS_SUB_GROUP_SIZE)]
            host += [("gradients (host)", pin(tpart * g)),
                     ("fp32 gradient buffer (host)", sum(pin(n * 4) for n in subs))]
            host += [(k + " (host)", v) for k, v in states]
            if off == OffloadDevice.nvme:
                # ZeRO-Infinity: fp32 param + m + v (+ grads) swap out; pinned swap buffers stay on host.
                nvme += tpart * (MASTER_BYTES + ADAM_STATE_BYTES + 4)
                host = [(k, v) for k, v in host if k not in ("fp32 master copies (host)", "optimizer states (host)")]
                host.append(("NVMe optimizer swap buffers (host)",
                             NVME_OPTIMIZER_BUFFERS * min(tpart, DS_SUB_GROUP_SIZE) * 4))
        else:
            dev += grad_buf + states
        if off_param and off == OffloadDevice.nvme:
            # Only partitions of at least one AIO block go to NVMe; smaller ones stay in host memory
            # (partition_parameters.py swappable_tensor). The swap buffers are page-locked by the AIO handle
            # (new_cpu_locked_tensor), so resident on CPU ranks too, however little the model swaps (measured:
            # one 953 MiB mapping fully resident on tiny GPT-2).
            threshold = plan.buckets.stage3_param_persistence_threshold
            swapped = [n for n in (math.ceil(t / N) for t in bd.tensors() if t > threshold) if n * p >= MIN_AIO_BYTES]
            nvme += sum(swapped) * p
            host = [(k, v) for k, v in host if k not in ("parameters (host)", PINNED_CACHE)]
            host.append(("parameters (host)", max(0, part - sum(swapped)) * p))
            count, size = NVME_PARAM_BUFFERS
            host.append(("NVMe param swap buffers (host)", count * size * swap_element_bytes))
    return ModelStates(phase(dev), host, nvme, tpart)


def step_transient(cfg: RunConfig, plan: Plan, bd: ParamBreakdown, part: int) -> int:
    """Device bytes the optimizer step adds on top of the persistent states (§2.3).

    - ZeRO-0, 16-bit, FusedAdam (CUDA): FP16_Optimizer.step flattens ``p.grad.to(fp32)`` → 4Ψ list + 4Ψ
      flat (fused_optimizer.py). On CPU ranks (torch AdamW → FP16_UnfusedOptimizer) each fp32 param
      gets an fp32 grad, 4Ψ, then torch's for-loop AdamW temporaries.
    - ZeRO-1/2: flat 16-bit partition copy + its fp32 copy (stage_1_and_2.py step: ``flat_grad_partition
      .to(fp32)``; the fp32 copy of fp32 grads is a no-op), 6Ψ/N in 16-bit.
    - ZeRO-3 the same per sub-group (stage3.py ``_prepare_fp32_grad_for_sub_group``: ``flatten(...).to(fp32)``).
      With optimizer offload the step runs on the host into persistent pinned buffers.
    - torch AdamW (CPU ranks, no offload) is the for-loop implementation (foreach is CUDA-only): about two
      fp32 temporaries of the largest tensor it updates (``exp_avg_sq.sqrt() / bc2`` then ``.add_``).
      Under ZeRO-1/2/3 that tensor is this rank's flat partition. FusedAdam/DeepSpeedCPUAdam: none.
    - fp16: the overflow check upcasts one grad at a time, 4 bytes × the largest (§2.3 "loss scaler").
    """
    dtype = Dtype(cfg.precision.dtype)
    g = DTYPE_BYTES[dtype]
    P, stage = bd.trainable, cfg.zero.stage  # the optimizer sees the trainable parameters only
    unfused = unfused_client_optimizer(plan)
    overflow = 4 * min(bd.largest_trainable, part if stage >= 2 else bd.largest_trainable) if dtype == Dtype.fp16 else 0
    if stage == 0:
        if dtype == Dtype.fp32:
            return optimizer_step_bytes(plan, bd.largest_trainable)
        if bf16_optimizer_pipeline(cfg, plan):
            # BF16_Optimizer (bf16_optimizer.py step): the flat 16-bit grad partition upcast to fp32, then the
            # optimizer steps that one flat fp32 partition, not tensor by tensor (measured: GPT-2 small, 2
            # stages, live tensors 331 MiB above a count that took the largest tensor).
            return 4 * part + optimizer_step_bytes(plan, part)
        if unfused:
            return 4 * P + optimizer_step_bytes(plan, bd.largest_trainable)
        return max(8 * P, overflow)
    sub = part if stage < 3 else min(part, DS_SUB_GROUP_SIZE)
    if plan.offload_optimizer:  # the step runs on the host: part of this "device" only on CPU ranks
        return overflow + (host_step_bytes(cfg, plan, sub) if plan.world.accelerator == "cpu" else 0)
    adam = optimizer_step_bytes(plan, sub)
    convert = sub * g + (sub * 4 if g != 4 else 0)
    # ZeRO-1/2 free the 16-bit grad partition once its fp32 copy exists (in fp32 the partition is the fp32
    # grad itself); ZeRO-3's flat gradient buffer stays (measured on CPU).
    fp32_grad = sub * 4 - (sub * g if stage < 3 else 0)
    return max(convert, fp32_grad + adam) + overflow


def unfused_client_optimizer(plan: Plan) -> bool:
    """A client optimizer of a CPU rank (torch AdamW, SGD, AdamW8bit): at ZeRO-0 in 16-bit DeepSpeed wraps it in
    FP16_UnfusedOptimizer (engine.py ``_do_optimizer_sanity_check``), which steps each fp32 master tensor on its own."""
    return plan.optimizer in (OptimizerImpl.torch_adamw, OptimizerImpl.bnb_adamw8bit, OptimizerImpl.torch_sgd) \
        and plan.world.accelerator == "cpu"


def unfused_startup_step(cfg: RunConfig, plan: Plan) -> bool:
    """FP16_UnfusedOptimizer's ``initialize_optimizer_states`` (unfused_optimizer.py) runs a whole step at
    start-up, on zero gradients of every parameter in 16-bit and in fp32: a ZeRO-0 16-bit run with a client
    optimizer on a CPU rank, not a bf16 pipeline (BF16_Optimizer)."""
    return cfg.zero.stage == 0 and Dtype(cfg.precision.dtype) != Dtype.fp32 and unfused_client_optimizer(plan) \
        and not bf16_optimizer_pipeline(cfg, plan)


def bf16_optimizer_pipeline(cfg: RunConfig, plan: Plan) -> bool:
    """A bf16 pipeline at ZeRO-0: DeepSpeed steps it with BF16_Optimizer (engine.py ``_do_optimizer_sanity_check``),
    on a flat partition as ZeRO-1/2 do."""
    return bool(plan.pipeline) and cfg.zero.stage == 0 and Dtype(cfg.precision.dtype) == Dtype.bf16


def checkpoint_bytes(cfg: RunConfig, plan: Plan, params: int) -> int:
    """Disk one checkpoint takes, over all ranks: the module's weights in its dtype, the fp32 masters (ZeRO ≥ 1
    or 16-bit) and the optimizer states (measured: tiny GPT-2 ZeRO-2 fp32, 954k parameters, 15.3 MB = 16 B per
    parameter, as this counts)."""
    weights = params * DTYPE_BYTES[Dtype(cfg.precision.dtype)]
    master = params * MASTER_BYTES if cfg.zero.stage >= 1 or Dtype(cfg.precision.dtype) != Dtype.fp32 else 0
    return weights + master + optimizer_state_bytes(cfg, plan, params)


def export_gather_bytes(cfg: RunConfig, plan: Plan, built_params: int, stage_params: int, exporter: bool,
                        tp_gathered: int = 0, other_stages: Tuple[int, ...] = ()) -> int:
    """What a rank holds beyond its states while the export is written (train/export.py): the rank that writes it
    (global rank 0, ``exporter``), and in a pipeline each other stage's sender; on a CPU rank, where that is the
    same host memory.

    - ZeRO-0/1/2: the module's own tensors; safetensors writes them from their memory (no copy on the host).
    - ZeRO-3: ``_zero3_consolidated_16bit_state_dict`` clones every gathered parameter on rank 0: the whole model
      in the module dtype.
    - A pipeline (pipeline/export.py ``gather_hf_state_dict``, over torch.distributed's object send/receive):
      rank 0 keeps its own stage uncopied and receives the others one at a time. Each stage it received stays,
      unpickled; the one in transit is there four times: the receive buffer, its ``tobytes()`` copy, and while it
      unpickles, each storage's bytes (the unpickler's memo keeps them) and the storage made of them. Each other
      stage's sender clones its stage, pickles the clone (a tensor's storage pickles as bytes of its own, which the
      pickler's memo keeps while it dumps) and copies the pickle into a byte tensor: three times its stage.
      ``other_stages``: what each other stage holds, a tied head's copy of the embedding included. Sampled inside
      the ranks (tcmalloc's live bytes; GPT-2 small, 2 stages of 309.5 MiB, fp32): rank 0 rose 1,220 MiB (3.9x),
      stage 1's sender 820 MiB.
    - Tensor parallelism below ZeRO-3 (engine._replace_module_consolidated_state_dict): each split tensor is
      all-gathered whole and rank 0's state dict keeps it (``tp_gathered`` elements); the whole ones are its own.
    """
    if not cfg.trainer.export or plan.world.accelerator != "cpu":
        return 0  # on a GPU rank both land in host memory (``param.detach().cpu()``), not on the device
    e = DTYPE_BYTES[Dtype(cfg.precision.dtype)]
    if plan.pipeline:
        if not exporter:
            return 3 * stage_params * e
        return (sum(other_stages) + 3 * max(other_stages, default=0)) * e
    if not exporter:
        return 0
    return built_params * e if cfg.zero.stage == 3 else tp_gathered * e


def export_pickle_blocks(cfg: RunConfig, plan: Plan, stage_params: int, exporter: bool,
                         other_stages: Tuple[int, ...] = ()) -> Tuple[int, ...]:
    """The export's blocks of a whole stage in one piece (a pipeline's pickles on a CPU rank; the stages' own
    tensors are many smaller blocks): rank 0's receive buffer and its ``tobytes()`` copy of the largest other stage,
    a sender's pickle stream and the byte tensor copied from it. A preloaded allocator places each in a freed span
    only where one is that large (memory/page_heap.py)."""
    if not (cfg.trainer.export and plan.pipeline and plan.world.accelerator == "cpu"):
        return ()
    e = DTYPE_BYTES[Dtype(cfg.precision.dtype)]
    stage = max(other_stages, default=0) if exporter else stage_params
    return (stage * e, stage * e) if stage else ()


def gradients_kept_after_step(cfg: RunConfig) -> bool:
    """Whether the gradients outlive the optimizer step (what the export finds): the engine's ``zero_grad`` sets
    them to None after each step (engine.py ``_take_model_step``; FP16_Optimizer's; stage_1_and_2.py's, which
    also drops the averaged gradients and the fp32 partition's); BF16_Optimizer keeps its fp32 gradients, zeroed,
    and ZeRO-3 its partitioned gradient buffer."""
    return cfg.zero.stage == 3 or (cfg.zero.stage == 0 and Dtype(cfg.precision.dtype) == Dtype.bf16)


def export_bytes(cfg: RunConfig, params: int) -> int:
    """The exported Hugging Face model: the weights in the training dtype (safetensors)."""
    return params * DTYPE_BYTES[Dtype(cfg.precision.dtype)] if cfg.trainer.export else 0

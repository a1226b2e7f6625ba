"""The typed run configuration: one dataclass per Hydra config group, every choice an Enum.

The YAML files under ``conf/`` pick values; these schemas say which keys exist, their types and defaults (Hydra
refuses unknown keys and wrong types while composing); the choices, one Enum each, are ``choices.py``'s. What the
values imply (task, batch geometry, offload, optimizer) is derived once in ``plan.py``; which combinations are
allowed lives in ``rules.py``; ``checks.py`` reports every problem at once.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .fields import MISSING_VALUE as MISSING  # omegaconf.MISSING, without importing OmegaConf

from .choices import (AdapterName, Allocator, DataFormat, Dtype, Family, GateMode, LauncherName, Monitor,  # noqa: F401
                      OffloadDevice, OptimizerName, ParallelMode, Partition, Rendezvous, Schedule, TaskName)
from .fields import PathKind, num, path_field, text


@dataclass
class ZeroConfig:
    stage: int = num(0, ge=0, le=3)
    """ZeRO stage 0-3: what is partitioned across data-parallel ranks (0 nothing, 1 optimizer
    states, 2 + gradients, 3 + parameters)."""
    reduce_bucket_size: Optional[int] = num(None, ge=1)
    """Elements per gradient-reduce bucket, one collective each. None: DDP's 25 MiB of gradients, capped at
    the model's parameter count (config/plan.py bucket_sizes); DeepSpeed's own default of 5e8 costs ~1 GiB
    in 16-bit, HF's "auto" (hidden²) ~150 collectives per micro-batch for GPT-2 small."""
    allgather_bucket_size: Optional[int] = num(None, ge=1)
    """Elements per all-gather bucket (stage 1-2). None: as reduce_bucket_size."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward. Costs extra bucket buffers (4.5x the bucket)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    stage3_prefetch_bucket_size: Optional[int] = num(None, ge=0)
    """Stage 3: elements prefetched ahead of use. None: 0.9·hidden²."""
    stage3_param_persistence_threshold: Optional[int] = num(None, ge=0)
    """Stage 3: parameters smaller than this stay whole on every rank. None: 10·hidden."""
    stage3_max_live_parameters: int = num(1_000_000_000, ge=1)
    """Stage 3: upper bound of gathered parameters alive at once."""
    stage3_max_reuse_distance: int = num(1_000_000_000, ge=0)
    """Stage 3: keep a gathered parameter if it is reused within this many elements."""


@dataclass
class OffloadConfig:
    device: OffloadDevice = OffloadDevice.none
    """Where optimizer states (and with ZeRO-3, parameters) live: none (accelerator), cpu, nvme."""
    params: Optional[bool] = None
    """Offload parameters too (ZeRO-3 only). None: yes with ZeRO-3; true below stage 3 is refused."""
    nvme_path: str = path_field(PathKind.out_dir)
    """Directory for NVMe offload swap files. Empty: <run dir>/nvme_swap."""
    pin_memory: bool = True
    """Pin host buffers: faster transfers, but pinned RAM cannot be swapped out."""


@dataclass
class PrecisionConfig:
    dtype: Dtype = Dtype.fp32
    """Training precision of the module: fp32, fp16 (loss-scaled) or bf16."""
    loss_scale: float = num(0.0, ge=0)
    """fp16 only: 0 selects dynamic loss scaling; a positive value is a static scale."""
    initial_scale_power: int = num(16, ge=0, le=32)
    """fp16 dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = num(1000, ge=1)
    """fp16: clean steps before the dynamic scale doubles."""
    hysteresis: int = num(2, ge=1)
    """fp16: overflows tolerated before the scale is halved."""
    min_loss_scale: float = num(1.0, gt=0)
    """fp16: the dynamic scale never drops below this."""


@dataclass
class ParallelConfig:
    mode: ParallelMode = ParallelMode.dp
    """dp: data parallel (ZeRO shards over all ranks); pipeline: model split into stages; tp: tensor parallel
    (DeepSpeed AutoTP) over groups of parallel.tp_size ranks, data parallel (ZeRO) across the groups."""
    stages: int = num(1, ge=1)
    """Pipeline stages (pipeline mode)."""
    micro_batches: int = num(0, ge=0)
    """Pipeline micro-batches per optimizer step; 0 derives it from the batch sizes."""
    partition: Partition = Partition.parameters
    """Pipeline layer partitioning: parameters (balance trainable parameters) | uniform (layers)."""
    tp_size: int = num(1, ge=1)
    """Tensor-parallel ranks (tp mode): each holds 1/tp_size of every attention and MLP projection (and an untied
    LM head); the world is tp_size × data-parallel ranks, and the ranks of one group read the same batches."""


@dataclass
class ModelConfig:
    name: str = text(MISSING, nonempty=True)
    """Short name of this model file (tiny-gpt2, gpt2, ...)."""
    family: Family = MISSING
    """Architecture family (zerorun/arch FAMILIES): decoders, or encoders trained for classification."""
    model_type: str = text("")
    """config.json's model_type: llama, qwen2 or mistral for family=llama; any transformers model_type for
    family=traced_decoder|traced_encoder (which transformers class builds it)."""
    from_config_json: bool = False
    """true (the ``hf`` model file): read the architecture from name_or_path's config.json when composing."""
    name_or_path: str = path_field(PathKind.source)
    """Hub name, local directory of a Hugging Face checkpoint, or pkg://<package>/<dir> for one a
    Python package ships; weights are read from it when pretrained=true."""
    pretrained: bool = False
    """true: load weights (and tokenizer) from name_or_path; false: random init from the architecture below."""
    num_layers: int = num(MISSING, ge=1)
    hidden_size: int = num(MISSING, ge=1)
    num_heads: int = num(MISSING, ge=1)
    intermediate_size: int = num(MISSING, ge=1)
    vocab_size: int = num(MISSING, ge=1)
    max_positions: int = num(MISSING, ge=1)
    type_vocab_size: int = num(2, ge=1)
    """BERT only: token-type embeddings."""
    num_kv_heads: Optional[int] = num(None, ge=1)
    """family=llama: key/value heads (grouped-query attention); None: as many as num_heads."""
    head_dim: Optional[int] = num(None, ge=1)
    """family=llama: per-head width; None: hidden_size / num_heads."""
    tie_word_embeddings: bool = False
    """family=llama: the LM head reuses the input embedding (GPT-2 always does)."""
    attention_bias: bool = False
    """family=llama, model_type llama: biases on the attention projections (qwen2 always has q/k/v biases)."""
    mlp_bias: bool = False
    """family=llama, model_type llama: biases on the MLP projections."""
    dropout: float = num(0.1, ge=0, lt=1)
    """Dropout on embeddings, attention and residuals (HF's default)."""
    hf_config: Dict[str, Any] = field(default_factory=dict)
    """family=traced_decoder|traced_encoder (any other model_type transformers builds): its config.json's fields, which build the
    model and from which zerorun plans it (zerorun/arch/traced.py); the fields above then only summarise it."""


@dataclass
class TaskConfig:
    name: TaskName = TaskName.auto
    """auto: causal_lm for the GPT-2 family, sequence_classification for BERT/RoBERTa."""
    num_labels: int = num(2, ge=1)
    """sequence_classification: number of classes."""


@dataclass
class LauncherConfig:
    name: LauncherName = LauncherName.deepspeed
    """deepspeed: the DeepSpeed CLI; torchrun: torch.distributed.run."""
    nproc_per_node: Optional[int] = num(None, ge=1)
    """Ranks per node. None: one per GPU; without GPUs, CPU ranks (min(2, cores))."""
    nnodes: int = num(1, ge=1)
    node_rank: int = num(0, ge=0)
    master_addr: str = text("127.0.0.1", nonempty=True)
    master_port: Optional[int] = num(None, ge=1, le=65535)
    """None: a free port on this machine."""
    hostfile: str = path_field(PathKind.file)
    """deepspeed multi-node: a hostfile ("host slots=N" per line)."""
    shared_run_dir: bool = True
    """Multi-node: the run dir is on a filesystem every node mounts (one run dir for the job). false: each
    node has its own (its own disk, as on SageMaker): checkpoints are node-local (DeepSpeed
    use_node_local_storage), each node keeps its own metrics and summary, global rank 0 alone exports.
    The preflight checks which it is."""
    rdzv: Rendezvous = Rendezvous.static
    """torchrun multi-node: static (launcher.node_rank on each node) or c10d (any start order; the node at
    launcher.master_addr hosts the rendezvous)."""
    rdzv_id: str = text("")
    """c10d: the job's id, the same on every node. Empty: the experiment name."""
    min_nnodes: Optional[int] = num(None, ge=1)
    """c10d: elastic, start with at least this many nodes (torchrun --nnodes MIN:MAX; MAX = launcher.nnodes)."""
    join_timeout_s: int = num(120, ge=1)
    """Multi-node, nodes other than 0: how long to wait for node 0's rendezvous port before failing (an
    unknown or unreachable launcher.master_addr fails at once)."""
    allocator: Allocator = Allocator.auto
    """CPU ranks' malloc (preloaded with LD_PRELOAD; PyTorch's CPU launcher does the same). auto: tcmalloc where
    it is installed, else jemalloc, else glibc at launcher.mmap_threshold_mib; the launch says which and why.
    tcmalloc ran the paired GPT-2 benchmark ~1.6x faster than glibc at 1 MiB for ~7% more resident memory
    (README "CPU ranks' allocator"). The gate plans for the one that runs. GPU ranks stay on glibc unless this
    is set. An LD_PRELOAD or MALLOC_CONF you set yourself wins (the gate plans for the allocator it preloads)."""
    mmap_threshold_mib: Optional[int] = num(None, ge=0, le=32)
    """CPU ranks: glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_), fixed, in MiB. A freed block at least this
    large goes back to the OS; smaller ones stay on the heap. 1: up to ~1 GiB less peak RSS on GPT-2 small,
    but every activation of 1 MiB or more is page-faulted anew each step (1.5x slower steps measured on small
    GPT-2s, benchmarks/throughput.py). 32 (glibc's own ceiling): fast, but tensors above 32 MiB (the logits)
    are still faulted anew. 0: mmap off, nothing trimmed: every freed block is reused (fastest, most resident).
    None (auto): the first of 0, 32 whose estimate fits with 15% to spare, else 1. autofit may lower an
    explicit 0 or 32 to 1 on CPU ranks (a config it may choose, ranked by predicted speed)."""
    mkl_fast_mm: bool = False
    """CPU ranks on tcmalloc: MKL's own memory manager, which keeps every fp32 GEMM's packing buffers (4-6 MiB
    apiece on GPT-2-sized layers) for the life of the process. false: MKL_DISABLE_FAST_MM=1, each buffer freed with
    its call: the cached ones, allocated in the first forward, landed inside the spans the activations had freed
    and cut them, so every later layer's blocks grew the heap (tiny GPT-2, ZeRO-1, fp32, checkpointing, micro
    16 x 176: 10 buffers, 46 MiB kept, the rank 578 MiB against 540 without them; docs/memory.md 5.4), and steps
    ran 1.12x faster without them (the paired benchmark, system zerorun@mkl-fast-mm). true: MKL keeps them. An
    MKL_DISABLE_FAST_MM you set wins."""
    heap_limit_mib: int = num(-1, ge=-1)
    """CPU ranks on tcmalloc: a ceiling on its page heap (gperftools' tcmalloc.heap_limit_mb), set in each rank once
    the engine is built and a checkpoint, if any, resumed. -1: the rank's share of the host's RAM (its capacity:
    available RAM capped by the cgroup, per rank), or its bound from the gate where that is higher, less what it
    holds outside the heap: tcmalloc returns free spans to the OS rather than grow the rank past it (its heap
    otherwise keeps what the allocation order leaves free, and grows for several steps), so placement alone cannot
    run the node out of RAM. Free while the heap stays under it; a rank held at it re-faults what it returned
    (10-21% slower steps measured on two ranks held 1.5-18% under their natural peak), which is why it is not the
    bound itself. 0: no ceiling. N: N MiB of heap (refused if below the tensors a rank holds at its peak; the
    gate's figures stay those of the unheld heap). Live memory above the ceiling fails as an out-of-memory error
    (the supervisor retries with a smaller micro-batch). A TCMALLOC_HEAP_LIMIT_MB you set wins."""
    expandable_segments: bool = True
    """CUDA ranks: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the allocator grows segments in place: far
    less reserved-but-unused memory, the usual cause of an OOM mid-run with memory to spare). The gate counts a
    smaller allocator margin with it (memory/estimate.py Calibration). A PYTORCH_CUDA_ALLOC_CONF you set wins."""
    stop_timeout_s: int = num(110, ge=1)
    """After a stop signal, seconds the ranks get to save a checkpoint before the launcher kills them
    (torchrun --shutdown-timeout; SageMaker sends SIGKILL 120 s after SIGTERM). The deepspeed launcher's own
    30 s per rank cannot be changed: zerorun does not pass it the signal (README "When things go wrong")."""

    @property
    def node_by_node(self) -> bool:
        """Several nodes, each started by its own zerorun (no hostfile): zerorun checks the rendezvous and the
        nodes' ranks compare their facts (train/preflight.py)."""
        return self.nnodes > 1 and not self.hostfile

    @property
    def node_local_run_dirs(self) -> bool:
        """Several nodes, each with a run dir of its own: node-local checkpoints, metrics and summary."""
        return self.nnodes > 1 and not self.shared_run_dir


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.adamw
    """adamw (DeepSpeed's fused/CPU Adam or torch's), adamw8bit (bitsandbytes, 8-bit states: numerics differ
    from adamw), sgd. lr, betas and weight decay are trainer.lr, trainer.adam_betas, trainer.weight_decay."""
    momentum: float = num(0.9, ge=0, lt=1)
    """sgd: momentum (0: no momentum buffer)."""
    min_8bit_size: int = num(4096, ge=0)
    """adamw8bit: tensors with fewer elements keep fp32 states (bitsandbytes' default). Under ZeRO the
    optimizer sees one flat partition per rank, so every parameter gets 8-bit states."""
    autofit_8bit: bool = False
    """gate=autofit may switch adamw to adamw8bit when nothing without offload fits. Off by default: 8-bit
    states change the numerics (slightly), not just the memory."""


@dataclass
class AdapterConfig:
    """Parameter-efficient fine-tuning (the peft library): the base model frozen, small adapters trained."""

    name: AdapterName = AdapterName.none
    """none: every parameter trains; lora: low-rank adapters on target_modules, the rest frozen; qlora: the same on
    a base stored in 4-bit NF4 with double quantization (bitsandbytes), computed in the run's precision."""
    r: int = num(8, ge=1, le=4096)
    """LoRA rank: each adapted in × out projection gains r·(in + out) trainable parameters."""
    alpha: float = num(16.0, gt=0)
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = num(0.05, ge=0, lt=1)
    """Dropout on the adapters' input."""
    target_modules: List[str] = field(default_factory=list)
    """Module names to adapt (peft's suffix match); empty: the family's default (peft's own: q/v projections)."""
    merge: bool = False
    """Export the merged model as a plain Hugging Face checkpoint as well as the adapter."""
    autofit_qlora: bool = False
    """gate=autofit with adapter=lora may store the frozen base in 4-bit (adapter=qlora) when nothing else fits
    (it changes the base's numerics, so only when allowed)."""


@dataclass
class TrainerConfig:
    max_steps: int = num(100, ge=1)
    """Optimizer steps to run."""
    micro_batch_size: int = num(8, ge=1)
    """Sequences per rank per forward/backward."""
    global_batch_size: Optional[int] = num(None, ge=1)
    """Sequences per optimizer step over all ranks. None: micro_batch_size × data-parallel ranks.
    Gradient accumulation = global / (micro × data-parallel ranks); it must divide."""
    lr: float = num(3e-4, gt=0, le=10)
    """Peak learning rate."""
    lr_schedule: Schedule = Schedule.cosine
    warmup_steps: int = num(10, ge=0)
    """Optimizer steps of linear warmup (0: the full LR from the first step)."""
    min_lr_ratio: float = num(0.1, ge=0, le=1)
    """cosine: the LR decays to lr × min_lr_ratio."""
    weight_decay: float = num(0.01, ge=0, le=1)
    """Decoupled weight decay (AdamW) or L2 (SGD)."""
    adam_betas: List[float] = num(ge=0, lt=1, length=2, factory=lambda: [0.9, 0.999])
    """AdamW's beta1, beta2, each in [0, 1)."""
    grad_clip: float = num(1.0, ge=0)
    """Clip the global gradient norm to this (0: off)."""
    save_every: int = num(0, ge=0)
    """Checkpoint every N optimizer steps (0: only at the end)."""
    keep_last: int = num(2, ge=1)
    """Keep this many complete checkpoints; older ones are deleted."""
    checkpoint_dir: str = path_field(PathKind.out_dir)
    """Where checkpoints go. Empty: <run dir>/checkpoints. On SageMaker: /opt/ml/checkpoints (synced to S3,
    copied back when a job restarts), so a restarted job resumes from it."""
    resume: bool = False
    """Resume from the newest complete checkpoint of this experiment (see resume_from)."""
    resume_from: str = path_field(PathKind.resume)
    """A run dir or checkpoint dir to resume from (setting it resumes: trainer.resume is implied); it must hold a
    complete checkpoint, else the launch is refused. Empty with trainer.resume=true: this run dir, else the newest
    run of the same experiment name that has a complete checkpoint, else a fresh start (said in one line)."""
    overwrite: bool = False
    """A run dir (or trainer.checkpoint_dir) that already holds complete checkpoints is refused unless the run
    resumes (trainer.resume=true) or this is true: then the earlier run's checkpoints are deleted first."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of keeping them."""
    fused_loss: Optional[bool] = None
    """true: a causal LM's head and loss computed a chunk of tokens at a time, gradients included, so its
    vocabulary-wide fp32 logits are never whole (zerorun.train.fused_loss): the same FLOPs and loss, the loss's
    largest term gone; data parallelism at ZeRO-0/1/2. null: on for CPU ranks wherever it runs (measured faster
    and smaller there), on GPUs the model's own loss unless gate=autofit turns it on when memory is short
    (config.rules.fused_loss_on). false: never."""
    fast_dropout_masks: bool = True
    """CPU ranks: dropout masks drawn 16 bits at a time from 64-bit words (zerorun.train.dropout_masks), 5x as
    fast as PyTorch's serial CPU bernoulli_; the keep-probability to 1/65536 (FlashAttention's: 1/255), from the
    same seeded generator, another random stream. false: PyTorch's kernel. GPU ranks keep CUDA's kernels."""
    eval_every: int = num(0, ge=0)
    """Evaluate every N steps (0: only at the end)."""
    progress: bool = True
    """Progress bar on rank 0."""
    export: bool = True
    """Save the final model (and tokenizer) in Hugging Face format under export_dir (global rank 0)."""
    report: bool = True
    """At the end of a run (or sweep), draw training.png, memory.png and report.md into the run dir (sweep:
    sweep.png), as zerorun-report does."""
    export_dir: str = path_field(PathKind.out_dir)
    """Where the export goes. Empty: <run dir>/export. On SageMaker: SM_MODEL_DIR (/opt/ml/model)."""
    oom_retries: int = num(3, ge=0)
    """A rank out of memory at runtime: relaunch from the last complete checkpoint this many times, each
    with the micro-batch halved and accumulation doubled (same global batch, same data order), at
    micro-batch 1 with the gate's next repair (checkpointing, buckets, ZeRO stage, offload). 0: stop."""
    max_restarts: int = num(0, ge=0)
    """A rank died (killed, segfault, lost peer): relaunch from the last complete checkpoint up to this many
    times, with a back-off. Not for bad config/data (exit 2) or a failure that repeats at the same step."""
    restart_backoff_s: float = num(10.0, ge=0)
    """Seconds before the first restart; doubled for each further one (capped at 5 minutes)."""
    collective_timeout_s: int = num(600, ge=1)
    """A collective that waits longer than this fails (a dead peer), instead of torch's 30 minutes."""


@dataclass
class DataConfig:
    name: str = text("auto", nonempty=True)
    """A label for the data set (the run dir and cache use it)."""
    path: str = path_field(PathKind.file)
    """A local file (txt, jsonl, csv). Empty: the built-in data set called `name` (synthetic: an
    English-like LM corpus; sentiment: a labelled review set), made by zerorun, offline."""
    format: DataFormat = DataFormat.auto
    """auto (from the file suffix) | txt | jsonl | csv."""
    text_column: str = text("text", nonempty=True)
    label_column: str = text("label", nonempty=True)
    """Classification: integer labels in [0, task.num_labels), or strings (sorted names map to 0..n-1)."""
    val_path: str = path_field(PathKind.file)
    """A separate validation file; empty: carve data.val_fraction out of data.path."""
    hf_dataset: str = text("")
    """A Hugging Face dataset name (needs the network and `pip install datasets`)."""
    hf_config_name: str = text("")
    hf_train_split: str = text("train", nonempty=True)
    hf_val_split: str = text("")
    """Empty: carve data.val_fraction out of the train split."""
    seq_len: int = num(128, ge=1)
    """Tokens per sequence: packed blocks for causal LM; the truncation length for classification
    (batches are padded only to their longest sequence)."""
    val_fraction: float = num(0.05, ge=0, lt=1)
    """Fraction held out for validation (carved with the seed)."""
    group_by_length: bool = True
    """Classification: batch examples of similar length together (padding to each batch's longest costs less);
    the order is still a function of the seed and epoch, so resume stays exact. No effect on packed LM blocks."""
    synthetic_docs: int = num(4000, ge=1)
    """Documents in the synthetic corpus."""
    tokenizer: str = path_field(PathKind.source, "auto")
    """auto: the model's own tokenizer when pretrained, else a byte-level BPE trained on the
    corpus (cached). Or a hub name / local tokenizer directory."""
    tokenizer_vocab: int = num(4096, ge=256)
    """Vocabulary of the trained BPE (capped at the model's vocab_size)."""
    cache_dir: str = path_field(PathKind.out_dir)
    """Where tokenized data is cached. Empty: $ZERORUN_CACHE or ~/.cache/zerorun."""


@dataclass
class HardwareConfig:
    """What to plan for. None: detect this machine."""
    gpus_per_node: Optional[int] = num(None, ge=0)
    gpu_mem_gib: Optional[float] = num(None, gt=0)
    nodes: Optional[int] = num(None, ge=1)
    host_mem_gib: Optional[float] = num(None, gt=0)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    name: str = text("${model.name}", nonempty=True)
    """Experiment name: groups run dirs (outputs/<name>/<time>) and resume looks there."""
    seed: int = num(1234, ge=0, lt=2**32)
    """Seeds every RNG (numpy takes [0, 2**32))."""
    dry_run: bool = False
    """Compose, check, estimate, render and write the run dir; print the command; do not launch."""
    verbose: bool = False
    """Show transformers' and DeepSpeed's INFO lines (their launcher's too) on the terminal; false: zerorun's own
    lines and the progress bar, the libraries' warnings and errors, their INFO in the run dir's libraries.log."""
    gate: GateMode = GateMode.strict
    """Memory gate before launch: strict (refuse what won't fit), warn, off, autofit, or calibrate (measure this
    config on this machine once, as zerorun-calibrate does, then gate strictly with the measured correction)."""
    monitor: Monitor = Monitor.none
    """Experiment tracking with DeepSpeed's own monitors, written under <run dir>/monitor: tensorboard, csv or
    wandb (project = the experiment name). Rank 0 logs the loss, tokens/s, LR and validation metrics per step."""
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed JSON merged over the rendered one (expert escape hatch; checked too)."""


@functools.lru_cache(maxsize=1)  # the ConfigStore is process-wide: once is enough (40 ms of every compose before)
def register_schemas() -> None:
    """Register the typed root schema; config.yaml lists it first so every group file is validated."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="config_schema", node=RunConfig)

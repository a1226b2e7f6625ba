"""Typed run configuration: one dataclass per Hydra config group, plus the cross-group checks.

The YAML files under ``conf/`` pick values; these schemas say which keys exist, their types and
their defaults. Hydra refuses unknown keys and wrong types while composing; ``check()`` then
finds every cross-key problem at once so the user fixes them in one go.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf


class OffloadDevice(str, enum.Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class Dtype(str, enum.Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


class ParallelMode(str, enum.Enum):
    dp = "dp"
    pipeline = "pipeline"


class LauncherName(str, enum.Enum):
    deepspeed = "deepspeed"
    torchrun = "torchrun"


class Schedule(str, enum.Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class GateMode(str, enum.Enum):
    strict = "strict"
    warn = "warn"
    off = "off"
    autofit = "autofit"


class Family(str, enum.Enum):
    gpt2 = "gpt2"
    bert = "bert"
    roberta = "roberta"


class TaskName(str, enum.Enum):
    auto = "auto"
    causal_lm = "causal_lm"
    sequence_classification = "sequence_classification"


@dataclass
class ZeroConfig:
    stage: int = 0
    """ZeRO stage 0-3: what is partitioned across data-parallel ranks (0 nothing, 1 optimizer
    states, 2 + gradients, 3 + parameters)."""
    reduce_bucket_size: Optional[int] = None
    """Elements per gradient-reduce bucket. None: hidden², as HF's "auto" does; DeepSpeed's own
    default of 5e8 costs ~1 GiB in 16-bit and makes CPU runs crawl."""
    allgather_bucket_size: Optional[int] = None
    """Elements per all-gather bucket (stage 1-2). None: hidden²."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward. Costs extra bucket buffers (4.5x the bucket)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    stage3_prefetch_bucket_size: Optional[int] = None
    """Stage 3: elements prefetched ahead of use. None: 0.9·hidden²."""
    stage3_param_persistence_threshold: Optional[int] = None
    """Stage 3: parameters smaller than this stay whole on every rank. None: 10·hidden."""
    stage3_max_live_parameters: int = 1_000_000_000
    """Stage 3: upper bound of gathered parameters alive at once."""
    stage3_max_reuse_distance: int = 1_000_000_000
    """Stage 3: keep a gathered parameter if it is reused within this many elements."""


@dataclass
class OffloadConfig:
    device: OffloadDevice = OffloadDevice.none
    """Where optimizer states (and with ZeRO-3, parameters) live: none (accelerator), cpu, nvme."""
    params: Optional[bool] = None
    """Offload parameters too (ZeRO-3 only). None: yes with ZeRO-3; true below stage 3 is refused."""
    nvme_path: str = ""
    """Directory for NVMe offload swap files. Empty: <run dir>/nvme_swap."""
    pin_memory: bool = True
    """Pin host buffers: faster transfers, but pinned RAM cannot be swapped out."""


@dataclass
class PrecisionConfig:
    dtype: Dtype = Dtype.fp32
    """Training precision of the module: fp32, fp16 (loss-scaled) or bf16."""
    loss_scale: float = 0.0
    """fp16 only: 0 selects dynamic loss scaling; a positive value is a static scale."""
    initial_scale_power: int = 16
    """fp16 dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16: clean steps before the dynamic scale doubles."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the scale is halved."""
    min_loss_scale: float = 1.0
    """fp16: the dynamic scale never drops below this."""


@dataclass
class ParallelConfig:
    mode: ParallelMode = ParallelMode.dp
    """dp: data parallel (ZeRO shards over all ranks); pipeline: model split into stages."""
    stages: int = 1
    """Pipeline stages (pipeline mode)."""
    micro_batches: int = 0
    """Pipeline micro-batches per optimizer step; 0 derives it from the batch sizes."""
    partition: str = "parameters"
    """Pipeline layer partitioning: parameters | uniform."""


@dataclass
class ModelConfig:
    name: str = MISSING
    """Short name of this model file (tiny-gpt2, gpt2, ...)."""
    family: Family = Family.gpt2
    """Architecture family: gpt2 (decoder) or bert / roberta (encoder)."""
    name_or_path: str = ""
    """Hub name, local directory of a Hugging Face checkpoint, or pkg://<package>/<dir> for one a
    Python package ships; weights are read from it when pretrained=true."""
    pretrained: bool = False
    """true: load weights (and tokenizer) from name_or_path; false: random init from the architecture below."""
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_heads: int = MISSING
    intermediate_size: int = MISSING
    vocab_size: int = MISSING
    max_positions: int = MISSING
    type_vocab_size: int = 2
    """BERT only: token-type embeddings."""
    dropout: float = 0.1
    """Dropout on embeddings, attention and residuals (HF's default)."""


@dataclass
class TaskConfig:
    name: TaskName = TaskName.auto
    """auto: causal_lm for the GPT-2 family, sequence_classification for BERT/RoBERTa."""
    num_labels: int = 2
    """sequence_classification: number of classes."""


@dataclass
class LauncherConfig:
    name: LauncherName = LauncherName.deepspeed
    """deepspeed: the DeepSpeed CLI; torchrun: torch.distributed.run."""
    nproc_per_node: Optional[int] = None
    """Ranks per node. None: one per GPU; without GPUs, CPU ranks (min(2, cores))."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None
    """None: a free port on this machine."""
    hostfile: str = ""
    """deepspeed multi-node: a hostfile ("host slots=N" per line)."""


@dataclass
class TrainerConfig:
    max_steps: int = 100
    """Optimizer steps to run."""
    micro_batch_size: int = 8
    """Sequences per rank per forward/backward."""
    global_batch_size: Optional[int] = None
    """Sequences per optimizer step over all ranks. None: micro_batch_size × data-parallel ranks.
    Gradient accumulation = global / (micro × data-parallel ranks); it must divide."""
    lr: float = 3e-4
    lr_schedule: Schedule = Schedule.cosine
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    """cosine: the LR decays to lr × min_lr_ratio."""
    weight_decay: float = 0.01
    adam_betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    save_every: int = 0
    """Checkpoint every N optimizer steps (0: only at the end)."""
    keep_last: int = 2
    """Keep this many complete checkpoints; older ones are deleted."""
    resume: bool = False
    """Resume from the newest complete checkpoint of this experiment (see resume_from)."""
    resume_from: str = ""
    """A run dir or checkpoint dir to resume from. Empty: this run dir, else the newest run
    of the same experiment name that has a complete checkpoint."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of keeping them."""
    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    progress: bool = True
    """Progress bar on rank 0."""
    export: bool = True
    """Save the final model (and tokenizer) in Hugging Face format under <run dir>/export."""


@dataclass
class DataConfig:
    name: str = "auto"
    """A label for the data set (the run dir and cache use it)."""
    path: str = ""
    """A local file (txt, jsonl, csv). Empty: the built-in data set called `name` (synthetic: an
    English-like LM corpus; sentiment: a labelled review set), made by zerorun, offline."""
    format: str = "auto"
    """auto (from the file suffix) | txt | jsonl | csv."""
    text_column: str = "text"
    label_column: str = "label"
    """Classification: integer labels in [0, task.num_labels), or strings (sorted names map to 0..n-1)."""
    val_path: str = ""
    """A separate validation file; empty: carve data.val_fraction out of data.path."""
    hf_dataset: str = ""
    """A Hugging Face dataset name (needs the network and `pip install datasets`)."""
    hf_config_name: str = ""
    hf_train_split: str = "train"
    hf_val_split: str = ""
    """Empty: carve data.val_fraction out of the train split."""
    seq_len: int = 128
    """Tokens per sequence: packed blocks for causal LM; the truncation length for classification
    (batches are padded only to their longest sequence)."""
    val_fraction: float = 0.05
    """Fraction held out for validation (carved with the seed)."""
    synthetic_docs: int = 4000
    """Documents in the synthetic corpus."""
    tokenizer: str = "auto"
    """auto: the model's own tokenizer when pretrained, else a byte-level BPE trained on the
    corpus (cached). Or a hub name / local tokenizer directory."""
    tokenizer_vocab: int = 4096
    """Vocabulary of the trained BPE (capped at the model's vocab_size)."""
    cache_dir: str = ""
    """Where tokenized data is cached. Empty: $ZERORUN_CACHE or ~/.cache/zerorun."""


@dataclass
class HardwareConfig:
    """What to plan for. None: detect this machine."""
    gpus_per_node: Optional[int] = None
    gpu_mem_gib: Optional[float] = None
    nodes: Optional[int] = None
    host_mem_gib: Optional[float] = None


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
    data: DataConfig = field(default_factory=DataConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    name: str = "${model.name}"
    """Experiment name: groups run dirs (outputs/<name>/<time>) and resume looks there."""
    seed: int = 1234
    dry_run: bool = False
    """Compose, check, estimate, render and write the run dir; print the command; do not launch."""
    gate: GateMode = GateMode.strict
    """Memory gate before launch: strict (refuse what won't fit), warn, off, autofit."""
    deepspeed: Dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed JSON merged over the rendered one (expert escape hatch; checked too)."""


def register_schemas() -> None:
    """Register the typed root schema; config.yaml lists it first so every group file is validated."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=RunConfig)


# ---------------------------------------------------------------------------------------------
# Checks


class ConfigError(ValueError):
    """One or more problems in the composed config; each names key, value and fix."""

    def __init__(self, problems: List[str]):
        self.problems = problems
        super().__init__("config is not valid:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class World:
    """How many ranks the run has: decided by the launcher config and the machine."""

    nproc_per_node: int
    nnodes: int
    accelerator: str  # "cuda" or "cpu"
    fp16_ok: bool = True  # whether the ranks' device can train in fp16

    @property
    def size(self) -> int:
        return self.nproc_per_node * self.nnodes


def unknown_keys(node: Any, schema: type, prefix: str = "") -> List[str]:
    """Keys in a composed config that the schema does not have.

    Hydra lets ``+trainer.max_step=3`` add a key even to a typed node, so a typo would be
    silently ignored; this walk catches it.
    """

    fields = {f.name: f for f in dataclasses.fields(schema)}
    found = []
    for key in node.keys() if hasattr(node, "keys") else []:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            found.append(f"{prefix}{key}" + (f" (did you mean {prefix}{close[0]}?)" if close else ""))
            continue
        ftype = fields[key].default_factory if fields[key].default_factory is not dataclasses.MISSING else None
        if ftype is not None and dataclasses.is_dataclass(ftype):
            found += unknown_keys(node[key], ftype, f"{prefix}{key}.")
    return found


def unknown_override_keys(overrides: List[str]) -> List[str]:
    """Problems for command-line overrides whose key is not in the schema (typos), before Hydra
    composes: Hydra's own message would suggest appending the typo with '+'."""
    problems = []
    for ov in overrides:
        if "=" not in ov or ov[0] in "+~" or ov.startswith(("hydra.", "hydra/", "-")):
            continue
        key = ov.split("=", 1)[0]
        node: Any = RunConfig
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(node):
                break  # a free-form dict (deepspeed.*) or a leaf: Hydra checks the rest
            fields = {f.name: f for f in dataclasses.fields(node)}
            if part not in fields:
                if i == 0 and len(parts) == 1:
                    break  # a group choice such as zero=stage2 is Hydra's to check
                close = difflib.get_close_matches(part, fields, n=1)
                where = ".".join(parts[:i]) or "the config"
                hint = f"did you mean {'.'.join(parts[:i] + [close[0]] + parts[i + 1:])}?" if close else \
                    f"{where} has: {', '.join(fields)}"
                problems.append(f"unknown key {key} ({hint}). Fix: correct the spelling.")
                break
            f = fields[part]
            node = f.default_factory if f.default_factory is not dataclasses.MISSING else None
    return problems


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """A plain, fully resolved RunConfig object (enums as enums) from a composed config."""
    if isinstance(cfg, RunConfig):
        return cfg
    extra = unknown_keys(cfg, RunConfig)
    if extra:
        raise ConfigError([f"unknown key {k}. Fix: check the spelling (zerorun --cfg job lists every key)."
                           for k in extra])
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)
    OmegaConf.resolve(merged)
    return OmegaConf.to_object(merged)


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


def resolved_task(cfg: RunConfig) -> TaskName:
    """The task to train: the user's, else the model family's natural one."""
    if cfg.task.name != TaskName.auto:
        return cfg.task.name
    return TaskName.causal_lm if cfg.model.family == Family.gpt2 else TaskName.sequence_classification


def data_parallel_size(cfg: RunConfig, world: World) -> int:
    if cfg.parallel.mode == ParallelMode.pipeline:
        return max(1, world.size // max(1, cfg.parallel.stages))
    return world.size


def global_batch(cfg: RunConfig, world: World) -> int:
    """Sequences per optimizer step over all ranks. A pipeline's parallel.micro_batches, when set,
    is the accumulation count (DeepSpeed's pipeline streams that many micro-batches per step)."""
    if cfg.trainer.global_batch_size:
        return cfg.trainer.global_batch_size
    accum = cfg.parallel.micro_batches if cfg.parallel.mode == ParallelMode.pipeline and cfg.parallel.micro_batches else 1
    return cfg.trainer.micro_batch_size * accum * data_parallel_size(cfg, world)


def grad_accum_steps(cfg: RunConfig, world: World) -> int:
    per_step = cfg.trainer.micro_batch_size * data_parallel_size(cfg, world)
    return max(1, global_batch(cfg, world) // per_step)


def libaio_available() -> bool:
    """NVMe offload needs libaio at run time (DeepSpeed's async_io op)."""
    import ctypes.util

    return ctypes.util.find_library("aio") is not None


def _writable_dir(path: str) -> bool:
    """Whether a directory exists and is writable, or can be created."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return False
        p = parent
    return os.path.isdir(p) and os.access(p, os.W_OK)


def check(cfg: RunConfig, world: World, *, libaio: Optional[bool] = None) -> List[str]:
    """Every cross-key problem in the config, each a sentence with key, value and fix.

    Pure except for two looks at the machine (libaio present, NVMe dir writable) which callers
    can pass in. An empty list means the config can be launched.
    """
    problems: List[str] = []
    z, off, prec, tr, m = cfg.zero, cfg.offload, cfg.precision, cfg.trainer, cfg.model

    if z.stage not in (0, 1, 2, 3):
        problems.append(f"zero.stage={z.stage}: ZeRO has stages 0-3. Fix: zero=stage0|stage1|stage2|stage3.")
    if off.device != OffloadDevice.none and z.stage == 0:
        problems.append(
            f"offload={off.device.value} with zero.stage=0: DeepSpeed offloads only ZeRO-partitioned state. "
            "Fix: zero=stage2 (optimizer offload) or zero=stage3 (parameters too), or offload=none."
        )
    if off.params and z.stage != 3:
        problems.append(
            f"offload.params=true with zero.stage={z.stage}: only ZeRO-3 partitions parameters, so only it can "
            "offload them. Fix: zero=stage3, or offload.params=false (optimizer states still offload)."
        )
    if off.params and off.device == OffloadDevice.none:
        problems.append("offload.params=true with offload=none: nowhere to offload to. Fix: offload=cpu or offload=nvme.")
    if off.device == OffloadDevice.nvme and z.stage != 3:
        problems.append(
            f"offload=nvme with zero.stage={z.stage}: DeepSpeed's NVMe offload (ZeRO-Infinity) needs ZeRO-3. "
            "Fix: zero=stage3, or offload=cpu."
        )
    if off.device == OffloadDevice.nvme:
        if not (libaio_available() if libaio is None else libaio):
            problems.append(
                "offload=nvme: libaio is not installed, DeepSpeed's async I/O op cannot build. "
                "Fix: apt-get install libaio-dev (Debian/Ubuntu), or offload=cpu."
            )
        if off.nvme_path and not _writable_dir(off.nvme_path):
            problems.append(
                f"offload.nvme_path={off.nvme_path}: not a writable directory. "
                "Fix: point it at a directory on a local NVMe disk you can write to."
            )
    if prec.dtype == Dtype.fp16 and not world.fp16_ok:
        problems.append(
            f"precision=fp16 on {world.accelerator} ranks: this device has no fp16 training support "
            "(DeepSpeed's CPU accelerator needs AVX512-FP16 or AMX). Fix: precision=bf16, or run on GPUs."
        )
    if prec.dtype != Dtype.fp16 and prec.loss_scale != 0:
        problems.append(
            f"precision.loss_scale={prec.loss_scale} with precision={prec.dtype.value}: loss scaling is for fp16 only. "
            "Fix: precision=fp16, or drop precision.loss_scale."
        )
    if prec.loss_scale < 0:
        problems.append(f"precision.loss_scale={prec.loss_scale}: must be 0 (dynamic) or a positive static scale.")
    if prec.dtype == Dtype.fp16 and prec.min_loss_scale <= 0:
        problems.append(f"precision.min_loss_scale={prec.min_loss_scale}: must be > 0. Fix: precision.min_loss_scale=1.")

    for key, value in (("trainer.max_steps", tr.max_steps), ("trainer.micro_batch_size", tr.micro_batch_size),
                       ("data.seq_len", cfg.data.seq_len)):
        if value < 1:
            problems.append(f"{key}={value}: must be at least 1.")
    if tr.lr <= 0:
        problems.append(f"trainer.lr={tr.lr}: must be positive. Fix: e.g. trainer.lr=3e-4.")
    if tr.save_every < 0:
        problems.append(f"trainer.save_every={tr.save_every}: must be 0 (only at the end) or a positive step count.")
    if not 0 <= cfg.data.val_fraction < 1:
        problems.append(f"data.val_fraction={cfg.data.val_fraction}: must be in [0, 1).")

    dp = data_parallel_size(cfg, world)
    if tr.global_batch_size is not None and tr.micro_batch_size >= 1:
        per_step = tr.micro_batch_size * dp
        if tr.global_batch_size < per_step or tr.global_batch_size % per_step:
            fit = max(1, tr.global_batch_size // per_step) * per_step
            problems.append(
                f"trainer.global_batch_size={tr.global_batch_size} is not a multiple of micro_batch_size × "
                f"data-parallel ranks = {tr.micro_batch_size} × {dp} = {per_step}. "
                f"Fix: trainer.global_batch_size={fit}, or a micro_batch_size that divides it."
            )

    if m.num_layers < 1 or m.hidden_size < 1 or m.num_heads < 1:
        problems.append(f"model {m.name}: num_layers, hidden_size and num_heads must be positive.")
    elif m.hidden_size % m.num_heads:
        problems.append(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}. "
            "Fix: choose heads that divide the hidden size."
        )
    if cfg.data.seq_len > m.max_positions:
        problems.append(
            f"data.seq_len={cfg.data.seq_len} exceeds model.max_positions={m.max_positions} of {m.name}. "
            f"Fix: data.seq_len={m.max_positions} or less."
        )

    task = resolved_task(cfg)
    if task == TaskName.causal_lm and m.family != Family.gpt2:
        problems.append(
            f"task=causal_lm with model {m.name} (family {m.family.value}): encoders are not causal LMs here. "
            "Fix: task=sequence_classification, or a GPT-2 model."
        )
    if task == TaskName.sequence_classification and m.family == Family.gpt2:
        problems.append(
            f"task=sequence_classification with model {m.name}: zerorun classifies with the BERT family. "
            "Fix: +model=tiny-bert|bert-base-uncased|minilm|roberta-base, or task=causal_lm."
        )
    if task == TaskName.sequence_classification and cfg.task.num_labels < 2:
        problems.append(f"task.num_labels={cfg.task.num_labels}: classification needs at least 2 labels.")
    if world.nproc_per_node < 1:
        problems.append(f"launcher.nproc_per_node={world.nproc_per_node}: must be at least 1.")
    if cfg.launcher.nnodes < 1:
        problems.append(f"launcher.nnodes={cfg.launcher.nnodes}: must be at least 1.")
    elif not 0 <= cfg.launcher.node_rank < cfg.launcher.nnodes:
        problems.append(
            f"launcher.node_rank={cfg.launcher.node_rank}: must be in [0, launcher.nnodes={cfg.launcher.nnodes})."
        )
    if cfg.launcher.name == LauncherName.deepspeed and cfg.launcher.nnodes > 1 and not cfg.launcher.hostfile:
        problems.append(
            f"launcher=deepspeed with launcher.nnodes={cfg.launcher.nnodes} and no launcher.hostfile: the deepspeed CLI "
            "starts other nodes only from a hostfile. Fix: launcher.hostfile=<file with 'host slots=N' lines>, "
            "or launcher=torchrun started on every node with launcher.node_rank (see launch/README.md)."
        )
    if cfg.launcher.nnodes > 1 and cfg.launcher.master_addr in ("127.0.0.1", "localhost") and not cfg.launcher.hostfile:
        problems.append(
            f"launcher.nnodes={cfg.launcher.nnodes} with launcher.master_addr={cfg.launcher.master_addr}: other nodes "
            "cannot reach this loopback address. Fix: launcher.master_addr=<node 0's hostname or IP>."
        )
    if cfg.parallel.mode == ParallelMode.pipeline:
        problems += _check_pipeline(cfg, world)

    problems += _check_deepspeed_overrides(cfg.deepspeed, prec.dtype)
    return problems


def _check_pipeline(cfg: RunConfig, world: World) -> List[str]:
    par, problems = cfg.parallel, []
    if cfg.zero.stage >= 2:
        problems.append(
            f"parallel=pipeline with zero.stage={cfg.zero.stage}: DeepSpeed refuses ZeRO-2 and ZeRO-3 with pipeline "
            "parallelism (they partition gradients/parameters across the pipeline's data-parallel groups). "
            "Fix: zero=stage1 or zero=stage0, or parallel=dp."
        )
    if par.stages < 1 or world.size % par.stages:
        problems.append(
            f"parallel.stages={par.stages} does not divide the world size {world.size} "
            f"({world.nnodes} node(s) × {world.nproc_per_node} rank(s)). Fix: parallel.stages="
            f"{max(d for d in range(1, world.size + 1) if world.size % d == 0 and d <= max(1, par.stages))}, "
            "or a rank count that is a multiple of it."
        )
    if par.stages > cfg.model.num_layers:
        problems.append(
            f"parallel.stages={par.stages} exceeds the {cfg.model.num_layers} transformer layers of {cfg.model.name}: "
            f"some stage would hold no layer. Fix: parallel.stages={cfg.model.num_layers} or fewer."
        )
    if par.partition not in ("parameters", "uniform"):
        problems.append(f"parallel.partition={par.partition}: must be parameters or uniform.")
    if par.micro_batches < 0:
        problems.append(f"parallel.micro_batches={par.micro_batches}: must be 0 (derived) or positive.")
    elif par.stages >= 1 and world.size % par.stages == 0:
        accum = grad_accum_steps(cfg, world)
        if par.micro_batches and cfg.trainer.global_batch_size and accum != par.micro_batches:
            problems.append(
                f"parallel.micro_batches={par.micro_batches} disagrees with trainer.global_batch_size="
                f"{cfg.trainer.global_batch_size} (which gives {accum} micro-batches per step). Fix: set one of them."
            )
        elif accum < par.stages:
            problems.append(
                f"{accum} micro-batch(es) per step for {par.stages} pipeline stages: most stages would sit idle "
                f"(the pipeline bubble). Fix: parallel.micro_batches={par.stages} or more (or a larger "
                "trainer.global_batch_size)."
            )
    return problems


# Top-level DeepSpeed keys zerorun renders itself; an override of these goes through the typed
# groups instead, so the check and the estimator see the real value.
_OWNED_DS_KEYS = {
    "train_batch_size": "trainer.global_batch_size",
    "train_micro_batch_size_per_gpu": "trainer.micro_batch_size",
    "gradient_accumulation_steps": "trainer.global_batch_size",
    "zero_optimization": "zero=... / offload=...",
    "fp16": "precision=fp16",
    "bf16": "precision=bf16",
}


def _check_deepspeed_overrides(overrides: Dict[str, Any], dtype: Dtype) -> List[str]:
    problems = []
    for key in overrides:
        enabled = isinstance(overrides[key], dict) and overrides[key].get("enabled")
        if key in ("fp16", "bf16") and enabled and dtype not in (Dtype.fp32, Dtype(key)):
            problems.append(
                f"deepspeed.{key}.enabled=true with precision={dtype.value}: fp16 and bf16 cannot both be enabled. "
                f"Fix: choose one, precision={key} or precision={dtype.value}, and drop deepspeed.{key}."
            )
        elif key in _OWNED_DS_KEYS:
            problems.append(
                f"deepspeed.{key}: zerorun renders this key from its config groups. Fix: set {_OWNED_DS_KEYS[key]} instead."
            )

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif node == "auto":
            problems.append(f'{path}="auto": zerorun renders complete values. Fix: give a number or drop the key.')

    walk(overrides, "deepspeed")
    return problems

"""Every choice a config field offers, one Enum each: the values the YAML files under ``conf/`` may pick and the
schemas in ``schema.py`` declare (Hydra refuses any other while composing)."""
from __future__ import annotations

import enum

from ..arch import FAMILIES


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
    tp = "tp"  # DeepSpeed AutoTP: each layer's linear weights split over parallel.tp_size ranks


class LauncherName(str, enum.Enum):
    deepspeed = "deepspeed"
    torchrun = "torchrun"


class Rendezvous(str, enum.Enum):
    static = "static"  # node ranks given (launcher.node_rank); node 0 at master_addr:master_port
    c10d = "c10d"      # torchrun: nodes join at master_addr:master_port in any order and get their rank


class Allocator(str, enum.Enum):
    """CPU ranks' memory allocator (launcher.allocator); auto resolves on the launching node (zerorun/allocators.py)."""
    auto = "auto"
    tcmalloc = "tcmalloc"
    jemalloc = "jemalloc"
    mimalloc = "mimalloc"
    glibc = "glibc"


class Schedule(str, enum.Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class Partition(str, enum.Enum):
    parameters = "parameters"
    uniform = "uniform"


class DataFormat(str, enum.Enum):
    auto = "auto"
    txt = "txt"
    jsonl = "jsonl"
    csv = "csv"


class OptimizerName(str, enum.Enum):
    adamw = "adamw"          # AdamW: fp32 momentum + variance, 8 bytes per parameter
    adamw8bit = "adamw8bit"  # bitsandbytes AdamW8bit: blockwise 8-bit states, ~2 bytes per parameter
    sgd = "sgd"              # SGD with momentum: one fp32 buffer, 4 bytes per parameter (0 without momentum)


class Monitor(str, enum.Enum):
    none = "none"
    tensorboard = "tensorboard"  # DeepSpeed's TensorBoard monitor (pip install tensorboard)
    csv = "csv"                  # DeepSpeed's CSV monitor
    wandb = "wandb"              # DeepSpeed's Weights & Biases monitor (pip install wandb; needs its login)


class GateMode(str, enum.Enum):
    strict = "strict"
    warn = "warn"
    off = "off"
    autofit = "autofit"
    calibrate = "calibrate"


Family = enum.Enum("Family", {name: name for name in FAMILIES}, type=str, module=__name__)
"""A model file's architecture family: the families zerorun/arch describes (GPT-2 and the Llama-class decoders,
BERT and RoBERTa encoders)."""


class AdapterName(str, enum.Enum):
    none = "none"
    lora = "lora"
    qlora = "qlora"

    @property
    def adapts(self) -> bool:
        """Adapters on a frozen base (peft): LoRA, or LoRA on a 4-bit base (QLoRA)."""
        return self in (AdapterName.lora, AdapterName.qlora)


class TaskName(str, enum.Enum):
    auto = "auto"
    causal_lm = "causal_lm"
    sequence_classification = "sequence_classification"

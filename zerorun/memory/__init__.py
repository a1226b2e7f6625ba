"""Per-rank peak memory of a zerorun launch, before it launches: pure arithmetic, no torch.

Each module is one section of docs/memory.md:

  §1 params.py       the parameter tensors of the model zerorun builds, by region
  §2 states.py       where parameters, gradients, fp32 masters and optimizer states live per ZeRO stage/offload
  §3 activations.py  what one micro-batch saves for backward, and the logits/loss transient
  §4 buffers.py      gradient buckets, ZeRO-3 gathered parameters, end-of-backward transients
  §5 estimate.py     the phases of a step, the peak over them, overheads, capacity
     priors.py       the terms no tensor count gives (context, NCCL, process, heap), calibration corrections
     bound.py        each term's uncertainty and the upper bound the gate decides on
  §6 stages.py       pipeline stages: layers, 1F1B depth, the pipeline engine's buffers
  §7 gate.py         refuse, warn, or autofit the fastest config that fits; the estimate table's rows
"""
from .activations import DTYPE_BYTES, Activations, activations, attention_kernel
from .estimate import Estimate, estimate, gib
from .priors import DEFAULT_CALIBRATION, OVERHEADS, Calibration, correction_key
from .gate import GateDecision, autofit, gate, resolve_mmap_threshold, table_configs, tp_table_configs
from .ladder import Change, runtime_oom_repair
from .params import ParamBreakdown, count_params, model_key, param_breakdown
from .stages import PipelineStage, partition_balanced, partition_uniform, pipeline_layer_params, pipeline_stages
from .states import STATE_NAMES, checkpoint_bytes, export_bytes

__all__ = [n for n in dir() if not n.startswith("_")]

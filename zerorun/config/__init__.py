"""The run configuration: schema → composition → checks → the resolved plan.

``schema`` (typed groups), ``load`` (typo check, composition), ``rules`` (what goes with what),
``plan`` (what a config implies on a world, computed once), ``checks`` (every problem at once),
``errors`` (the one user-error type).
"""
from .checks import OWNED_DS_KEYS, check
from .errors import ConfigError, DataError, ModelLoadError, UserError
from .load import (compose, group_options, schema_problem, to_run_config, unknown_group_choices, unknown_keys,
                   unknown_override_keys)
from .plan import Buckets, Plan, World, bucket_sizes, data_parallel_size, global_batch, grad_accum_steps, \
    make_plan, plan_world, small_bucket_sizes, tensor_parallel_size
from .rules import Layout, OptimizerImpl, default_task, layouts, offload_problems, params_offloaded, resolve_task
from .schema import (AdapterConfig, AdapterName, Allocator, DataConfig, DataFormat, Dtype, Family, GateMode, HardwareConfig, LauncherConfig, LauncherName,
                     Monitor, ModelConfig, OffloadConfig, OffloadDevice, OptimizerConfig, OptimizerName, ParallelConfig, ParallelMode, Partition,
                     PrecisionConfig, Rendezvous, RunConfig, Schedule, TaskConfig, TaskName, TrainerConfig, ZeroConfig,
                     register_schemas)

__all__ = [n for n in dir() if not n.startswith("_")]

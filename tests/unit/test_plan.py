"""The resolved plan: what a config implies on a world, computed once, and its round trip through plan.json."""
import json

from helpers import CPU2, GPU8, composed
from zerorun.config import OptimizerImpl, Plan, TaskName, make_plan


def test_the_plan_resolves_task_batch_offload_and_optimizer():
    plan = make_plan(composed("+model=tiny-bert", "zero=stage3", "offload=cpu", "trainer.micro_batch_size=4",
                              "trainer.global_batch_size=64"), GPU8)
    assert plan.task == TaskName.sequence_classification
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.global_batch_size, plan.data_parallel_size) == (4, 2, 64, 8)
    assert plan.offload_optimizer and plan.offload_params  # offload.params unset means yes at ZeRO-3
    assert plan.optimizer == OptimizerImpl.cpu_adam
    assert plan.buckets.reduce_bucket_size == 128 * 128
    assert plan.tokens_per_step == 64 * plan.seq_len


def test_optimizer_implementation_follows_ranks_and_offload():
    assert make_plan(composed(), CPU2).optimizer == OptimizerImpl.torch_adamw
    assert make_plan(composed(), GPU8).optimizer == OptimizerImpl.fused_adam
    assert make_plan(composed("zero=stage2", "offload=cpu"), CPU2).optimizer == OptimizerImpl.cpu_adam
    assert not make_plan(composed("zero=stage3", "offload=cpu", "offload.params=false"), CPU2).offload_params


def test_pipeline_plan():
    plan = make_plan(composed("parallel=pipeline", "parallel.micro_batches=4"), CPU2)
    assert plan.pipeline and plan.pipeline_stages == 2 and plan.data_parallel_size == 1 and plan.grad_accum_steps == 4


def test_plan_round_trips_through_json():
    plan = make_plan(composed("zero=stage3", "offload=nvme", "offload.nvme_path=/nvme"), GPU8)
    back = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back == plan and back.nvme_path == "/nvme"

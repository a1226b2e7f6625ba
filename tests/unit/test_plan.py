"""The resolved plan: what a config implies on a world, computed once, and its round trip through plan.json."""
import json

import pytest

from helpers import CPU2, GPU8, composed
from zerorun.config import OptimizerImpl, Plan, TaskName, make_plan


def test_the_plan_resolves_task_batch_offload_and_optimizer():
    plan = make_plan(composed("+model=tiny-bert", "zero=stage3", "offload=cpu", "trainer.micro_batch_size=4",
                              "trainer.global_batch_size=64"), GPU8)
    assert plan.task == TaskName.sequence_classification
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.global_batch_size, plan.data_parallel_size) == (4, 2, 64, 8)
    assert plan.offload_optimizer and plan.offload_params  # offload.params unset means yes at ZeRO-3
    assert plan.optimizer == OptimizerImpl.cpu_adam
    # Smaller than DDP's 25 MiB: one bucket holds every gradient (4,386,178), rounded up to a multiple of 64
    assert plan.buckets.reduce_bucket_size == plan.buckets.allgather_bucket_size == 4_386_240
    assert plan.tokens_per_step == 64 * plan.seq_len


@pytest.mark.heavy
def test_buckets_are_ddps_25_mib_capped_at_the_model():
    sizes = lambda *o: make_plan(composed(*o), GPU8).buckets.reduce_bucket_size  # noqa: E731
    assert sizes("+model=gpt2") == 25 * 2**20 // 4  # fp32 gradients
    assert sizes("+model=gpt2", "precision=bf16") == 25 * 2**20 // 2
    assert sizes("+model=gpt2", "zero.reduce_bucket_size=1000") == 1000  # the user's


@pytest.mark.heavy
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


@pytest.mark.heavy
def test_padded_batches_are_planned_at_the_longest_example_not_data_seq_len():
    """Classification pads each batch to its own longest row: 10-token reviews under data.seq_len=128 never make a
    128-token batch (the estimate read +31% of MiniLM's peak RSS). Packed LM blocks are always seq_len long."""
    from zerorun import memory as M
    from zerorun.hardware import GIB, Hardware

    hw = Hardware("cpu", 0, 0, 24 * GIB, 1, 2, fp16_ok=False)
    bert = composed("+model=minilm", "data.seq_len=128", "trainer.micro_batch_size=16")
    short, full = make_plan(bert, CPU2, longest=20), make_plan(bert, CPU2)
    assert (short.seq_len, full.seq_len) == (20, 128)
    assert make_plan(bert, CPU2, longest=500).seq_len == 128  # truncated at data.seq_len
    peak = lambda plan: M.estimate(bert, plan, hw).per_rank_peak_bytes  # noqa: E731
    assert peak(short) < peak(full) - 100 * 2**20
    gpt = composed("+model=tiny-gpt2", "data.seq_len=128")
    assert make_plan(gpt, CPU2, longest=20).seq_len == 128

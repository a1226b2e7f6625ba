"""The step-time model (zerorun/speed.py) and the autofit that ranks by it.

The model's figures are checked against real runs by benchmarks/autofit_rank.py (docs/speed.md); here: each
term moves the way its cause says, and autofit takes the fastest predicted config that fits.
"""
import pytest

from helpers import CPU2, GPU8, composed, planned
from zerorun.config import World, make_plan, plan_world
from zerorun.hardware import resolve_hardware
from zerorun.memory import estimate
from zerorun.memory.gate import SPEED_TIE, autofit
from zerorun.memory.ladder import apply as _apply, candidates as _candidates
from zerorun.speed import CPU_RANK, CUDA_GPU, predict_step_time

GPT2 = ("+model=gpt2", "precision=bf16", "data.seq_len=1024", "trainer.micro_batch_size=4")


def terms(*overrides, world=GPU8):
    cfg, plan = planned(*overrides, world=world)
    return predict_step_time(cfg, plan)


@pytest.mark.heavy
def test_each_term_follows_its_cause():
    base = terms(*GPT2, "zero=stage2")
    assert base.terms["compute"] > 0 and base.terms["recompute"] == 0 and base.tokens_per_s > 0
    assert base.tokens_per_step == 4 * 8 * 1024
    ckpt = terms(*GPT2, "zero=stage2", "trainer.activation_checkpointing=true")
    # Recomputation is one more forward of the layers: a quarter to a third of the compute.
    assert 0.2 * base.terms["compute"] < ckpt.terms["recompute"] < 0.34 * base.terms["compute"]
    z3 = terms(*GPT2, "zero=stage3")
    assert z3.terms["param_comm"] > 2 * base.terms["param_comm"]  # gathered every forward and backward
    big = terms(*GPT2, "zero=stage2", "zero.reduce_bucket_size=200000000")
    small = terms(*GPT2, "zero=stage2", "zero.reduce_bucket_size=10000")
    assert small.terms["grad_comm"] > 2 * big.terms["grad_comm"]  # one latency per bucket
    one = terms(*GPT2, "zero=stage2", world=World(1, 1, "cuda"))
    assert "grad_comm" not in one.terms and "param_comm" not in one.terms
    off = terms(*GPT2, "zero=stage2", "offload=cpu")
    assert off.terms["offload"] > 0 and off.terms["optimizer"] > 10 * base.terms["optimizer"]  # CPU Adam
    nodes = terms(*GPT2, "zero=stage2", world=World(4, 2, "cuda"))
    assert nodes.terms["grad_comm"] > 2 * base.terms["grad_comm"]  # between nodes, not NVLink


@pytest.mark.heavy
def test_smaller_micro_batches_cost_per_micro_batch_overhead_and_efficiency():
    big = terms(*GPT2, "trainer.global_batch_size=64")
    small = terms(*GPT2, "trainer.global_batch_size=64", "trainer.micro_batch_size=1")
    assert small.tokens_per_step == big.tokens_per_step
    assert small.terms["overhead"] == pytest.approx(4 * big.terms["overhead"])
    assert small.seconds > big.seconds


@pytest.mark.heavy
def test_cpu_ranks_pay_page_faults_at_a_low_mmap_threshold():
    # 1 MiB: every activation is mapped and faulted anew each micro-batch; 32: the larger ones (the logits);
    # 0 (mmap off): none.
    off = terms("+model=tiny-gpt2", "launcher.mmap_threshold_mib=0", "data.seq_len=512", world=CPU2)
    fast = terms("+model=tiny-gpt2", "launcher.mmap_threshold_mib=32", "data.seq_len=512", world=CPU2)
    slow = terms("+model=tiny-gpt2", "launcher.mmap_threshold_mib=1", "data.seq_len=512", world=CPU2)
    assert slow.terms["page_faults"] > fast.terms["page_faults"] > off.terms.get("page_faults", 0) == 0
    assert slow.seconds > fast.seconds > off.seconds
    assert "page_faults" not in terms(*GPT2).terms  # GPU ranks: their activations are not host pages


def test_a_pipeline_pays_its_bubble():
    cfg, plan = planned("+model=gpt2", "parallel=pipeline", "parallel.stages=2", "parallel.micro_batches=4",
                        "trainer.micro_batch_size=2", world=World(2, 1, "cuda"))
    st = predict_step_time(cfg, plan)
    slot = sum(v for k, v in st.terms.items() if k in ("compute", "overhead")) / 4
    assert st.terms["bubble"] == pytest.approx(slot, rel=1e-6)  # (stages - 1) idle micro-batch slots


@pytest.mark.heavy
def test_profiles_are_picked_by_accelerator():
    cfg, plan = planned("+model=tiny-gpt2", world=CPU2)
    assert predict_step_time(cfg, plan).seconds == predict_step_time(cfg, plan, CPU_RANK).seconds
    assert predict_step_time(cfg, plan, CUDA_GPU).seconds < predict_step_time(cfg, plan, CPU_RANK).seconds


@pytest.mark.heavy
@pytest.mark.parametrize("overrides", [
    ("+model=gpt2-large", "precision=bf16", "data.seq_len=1024", "trainer.micro_batch_size=8",
     "hardware.gpus_per_node=8", "hardware.gpu_mem_gib=12", "hardware.host_mem_gib=256"),
    ("+model=gpt2", "zero=stage2", "precision=bf16", "data.seq_len=1024", "trainer.micro_batch_size=16",
     "hardware.gpus_per_node=8", "hardware.gpu_mem_gib=5", "hardware.host_mem_gib=256"),
    ("+model=tiny-gpt2", "trainer.micro_batch_size=16", "data.seq_len=256", "launcher.mmap_threshold_mib=32",
     "hardware.gpus_per_node=0", "hardware.host_mem_gib=1.5", "launcher.nproc_per_node=2"),
])
def test_autofit_takes_the_fastest_predicted_config_that_fits(overrides):
    cfg = composed(*overrides)
    hw = resolve_hardware(cfg.hardware, None)
    world = plan_world(cfg, hw)
    plan = make_plan(cfg, world)
    fit = autofit(cfg, plan, hw)
    assert fit is not None and fit.estimate.fits
    ladder = []  # (overrides, predicted s) of every config that fits, in the ladder's order
    for k in _candidates(cfg, world, plan.global_batch_size):
        new, changes = _apply(cfg, world, k, plan.global_batch_size)
        new_plan = make_plan(new, world)
        if estimate(new, new_plan, hw).fits:
            ladder.append(([c.override() for c in changes], predict_step_time(new, new_plan).seconds))
    assert fit.fitting == len(ladder) > 1
    fastest = min(t for _, t in ladder)
    assert fit.step.seconds <= fastest * (1 + SPEED_TIE)
    # The tie rule: the first rung of the ladder within SPEED_TIE of the fastest, not simply the fastest.
    first = next(o for o, t in ladder if t <= fastest * (1 + SPEED_TIE))
    assert [c.override() for c in fit.changes] == first


@pytest.mark.heavy
def test_autofit_beats_the_fixed_ladder_where_a_larger_micro_batch_is_worth_a_change():
    # 8 × 13 GiB for GPT-2 large: the fixed ladder (micro-batch first, then checkpointing, then a higher stage)
    # stopped at ZeRO-1 with micro-batch 1; the step-time model keeps a larger micro-batch (recomputation costs
    # a third of the layers' compute; 64 micro-batches of 1 token row cost overhead and GPU efficiency).
    cfg = composed("+model=gpt2-large", "precision=bf16", "data.seq_len=1024", "trainer.micro_batch_size=8",
                   "hardware.gpus_per_node=8", "hardware.gpu_mem_gib=13", "hardware.host_mem_gib=256", "gate=autofit",
                   "trainer.fused_loss=false")  # (the ladder without the fused loss, whose micro-batch it raises)
    hw = resolve_hardware(cfg.hardware, None)
    world = plan_world(cfg, hw)
    plan = make_plan(cfg, world)
    fit = autofit(cfg, plan, hw)
    ladder = next(new for new, _ in (_apply(cfg, world, k, plan.global_batch_size)
                                     for k in _candidates(cfg, world, plan.global_batch_size))
                  if estimate(new, make_plan(new, world), hw).fits)
    assert ladder.trainer.micro_batch_size == 1
    assert fit.cfg.trainer.micro_batch_size > 1, fit.changes
    assert fit.step.seconds < 0.97 * predict_step_time(ladder, make_plan(ladder, world)).seconds
    from zerorun.memory import gate

    d = gate(cfg, plan, hw)
    assert d.ok and d.step is not None and "predicted" in d.message and "of the fastest of" in d.message
    assert d.cfg == fit.cfg


def test_a_gradient_larger_than_the_bucket_is_reduced_in_one_call():
    from zerorun.memory import param_breakdown
    from zerorun.speed import reduce_calls

    cfg = composed("+model=gpt2")
    bd = param_breakdown(cfg.model)
    h2 = cfg.model.hidden_size ** 2
    big = sum(1 for t in (*bd.embedding_tensors, *bd.layer_tensors * bd.num_layers, *bd.head_tensors) if t > h2)
    calls = reduce_calls(bd, h2)
    # The 38.6M-element word embedding is one call of its own, not 65 bucket-fulls.
    assert big < calls < big + bd.total // h2 - bd.embedding_tensors[0] // h2 + 2
    assert reduce_calls(bd, 10**9) == 1  # everything fits one bucket


@pytest.mark.heavy
def test_lora_steps_and_reduces_only_the_adapters_and_skips_the_frozen_weight_gradients():
    """A frozen base has no weight-gradient matmuls (backward 2 FLOPs per weight instead of 4) and nothing to
    reduce, gather or step but the adapters: the speed model autofit ranks by knows it (issue 26)."""
    from zerorun.memory import param_breakdown

    base = ("+model=llama-3.2-1b", "zero=stage2", "precision=bf16", "data.seq_len=512", "trainer.micro_batch_size=1")
    full, lora = terms(*base).terms, terms(*base, "adapter=lora").terms
    cfg, plan = planned(*base, "adapter=lora")
    bd = param_breakdown(cfg.model, plan.task, cfg.task.num_labels, cfg.adapter)
    share = bd.trainable / bd.total
    assert share < 0.001
    for term in ("optimizer", "grad_comm", "param_comm"):
        assert lora[term] < 10 * share * full[term], term
    # The weights' matmuls are ~4/6 of full training's; attention's and the LM head's are not all weight FLOPs.
    assert 0.6 < lora["compute"] / full["compute"] < 0.8
    assert sum(lora.values()) < sum(full.values())

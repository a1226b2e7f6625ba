"""The memory estimator: exact parameter counts, the shape of the estimate, the gate and autofit.

Pure arithmetic except the parameter-count checks, which build meta-device models (no memory).
"""
import dataclasses
import json
import time

import pytest

from helpers import A100_8, CPU2, CPU_HOST, GPU8, MODEL_FILES, composed, model_file
from zerorun import memory as M
from zerorun.arch import traits
from zerorun.config import (Family, GateMode, HardwareConfig, ModelConfig, World, default_task, global_batch,
                            grad_accum_steps, make_plan, plan_world)
from zerorun.hardware import GIB, Hardware, needs_detection, resolve_hardware
from zerorun.memory.ladder import candidates as _candidates

BERT_TINY = ModelConfig(name="bert-tiny", family=Family.bert, num_layers=2, hidden_size=128, num_heads=2,
                        intermediate_size=512, vocab_size=30522, max_positions=512)
BERT_BASE = ModelConfig(name="bert-base", family=Family.bert, num_layers=12, hidden_size=768, num_heads=12,
                        intermediate_size=3072, vocab_size=30522, max_positions=512)


def estimate(cfg, world, hw):
    return M.estimate(cfg, make_plan(cfg, world), hw)


def gate(cfg, world, hw, mode=None):
    return M.gate(cfg, make_plan(cfg, world), hw, mode)


# --------------------------------------------------------------------------------------------- parameters


def meta_model(m: ModelConfig, num_labels: int = 2):
    """The model zerorun.models.build_model makes for the family's task, on the meta device."""
    import torch

    from zerorun.models import hf_config, model_class

    with torch.device("meta"):
        return model_class(default_task(m.family)).from_config(hf_config(m, num_labels))


def region_numel(model, prefixes):
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes))


REGIONS = {
    Family.gpt2: (("transformer.wte.", "transformer.wpe."), "transformer.h.0.", ("transformer.ln_f.",)),
    Family.bert: ("bert.embeddings.", "bert.encoder.layer.0.", ("bert.pooler.", "classifier.")),
    Family.roberta: ("roberta.embeddings.", "roberta.encoder.layer.0.", ("classifier.",)),
    Family.llama: ("model.embed_tokens.", "model.layers.0.", ("model.norm.", "lm_head.")),
}


# The families zerorun has arithmetic for; a traced family's counts are the census of the model transformers builds,
# checked against the published sizes in tests/unit/test_traced.py.
HAND_WRITTEN = [m for m in map(model_file, MODEL_FILES) if m.family in REGIONS] + [BERT_TINY, BERT_BASE]


@pytest.mark.heavy
@pytest.mark.parametrize("m", HAND_WRITTEN, ids=lambda m: m.name)
def test_param_count_matches_transformers(m):
    model = meta_model(m)
    unique = {id(p): p.numel() for p in model.parameters()}  # the tied LM head is the same tensor as wte
    bd = M.param_breakdown(m)
    assert M.count_params(m) == bd.total == sum(unique.values())
    emb, layer0, head = REGIONS[m.family]
    if m.family == Family.gpt2:
        assert model.lm_head.weight is model.transformer.wte.weight
        assert bd.tied_embedding == model.lm_head.weight.numel()
    elif m.family == Family.llama:  # tied or not as the config says (Llama-3.2-1B and small Qwen2.5 are)
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert tied == m.tie_word_embeddings and bd.tied_embedding == (model.lm_head.weight.numel() if tied else 0)
    else:
        assert bd.tied_embedding == 0
    assert bd.embeddings == region_numel(model, emb)
    assert bd.per_layer == region_numel(model, layer0)
    assert bd.head == region_numel(model, head)
    assert bd.largest_tensor == max(unique.values())
    assert bd.buffer_bytes == sum(b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.heavy
@pytest.mark.parametrize("labels", [2, 5])
def test_param_count_with_num_labels_and_gpt2_classifier(labels):
    from zerorun.config import TaskName

    bert = meta_model(BERT_TINY, labels)
    expected = sum(p.numel() for p in bert.parameters())
    assert M.count_params(BERT_TINY, TaskName.sequence_classification, labels) == expected
    import torch

    from zerorun.models import hf_config, model_class

    gpt2 = model_file("tiny-gpt2")
    with torch.device("meta"):
        cls = model_class(TaskName.sequence_classification).from_config(hf_config(gpt2, labels))
    assert M.count_params(gpt2, TaskName.sequence_classification, labels) == sum(p.numel() for p in cls.parameters())


def test_known_sizes():
    assert M.count_params(model_file("gpt2")) == 124_439_808  # HF's count for openai-community/gpt2
    assert M.count_params(BERT_BASE) == 109_483_778  # bert-base-uncased + 2-way classifier


# --------------------------------------------------------------------------------------------- estimate


def est(*overrides, world=GPU8, hw=A100_8):
    return estimate(composed(*overrides), world, hw)


@pytest.mark.heavy
@pytest.mark.parametrize("model", ["gpt2", "gpt2-xl"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_states_shrink_with_stage(model, precision):
    states = [est(f"+model={model}", f"zero=stage{s}", f"precision={precision}").model_state_bytes for s in range(4)]
    assert states[3] <= states[2] <= states[1] <= states[0]
    assert states[3] < states[0] / 4  # 16Ψ → ~16Ψ/N at N=8 (§1.1)


@pytest.mark.heavy
def test_checkpointing_reduces_activations():
    base = ("+model=gpt2-medium", "zero=stage2", "precision=bf16", "data.seq_len=1024", "trainer.micro_batch_size=8")
    off, on = est(*base), est(*base, "trainer.activation_checkpointing=true")
    assert on.phases["loss"]["activations"] < off.phases["loss"]["activations"] / 10
    assert on.per_rank_peak_bytes < off.per_rank_peak_bytes
    assert on.phases["backward"]["activations"] > on.phases["loss"]["activations"]  # the recomputed layer


@pytest.mark.heavy
def test_offload_moves_optimizer_to_host():
    base = ("+model=gpt2-large", "zero=stage2", "precision=bf16")
    dev, off = est(*base), est(*base, "offload=cpu")
    P = M.count_params(model_file("gpt2-large"))
    part = -(-P // 8)
    assert dev.phases["optimizer step"]["optimizer states"] == 8 * part
    assert "optimizer states" not in off.phases["optimizer step"]
    assert "fp32 master copies" not in off.phases["optimizer step"]
    pinned = M.states.pinned_resident  # GPU ranks: DeepSpeed page-locks the master (power-of-two blocks)
    assert off.host_components["optimizer states (host)"] == 8 * part
    assert off.host_components["fp32 master copies (host)"] == pinned(4 * part)
    assert off.per_rank_peak_bytes < dev.per_rank_peak_bytes
    # ZeRO-3 parameter offload moves the 16-bit partition too; NVMe puts the fp32 states on disk.
    z3 = est("+model=gpt2-large", "zero=stage3", "precision=bf16", "offload=cpu")
    assert z3.host_components["parameters (host)"] == pinned(2 * part)
    assert "parameters" not in z3.phases["optimizer step"]
    nvme = est("+model=gpt2-large", "zero=stage3", "precision=bf16", "offload=nvme")
    # The 16-bit partitions of at least one AIO block (1 MiB) go to NVMe; the small ones (LayerNorms, biases)
    # stay in host memory beside the page-locked swap buffers (5 × 1e8 elements of bf16 here).
    on_host = nvme.host_components["parameters (host)"]
    assert 0 < on_host < 0.1 * 2 * part  # gpt2-large: attention c_proj (1280², 400 KB a partition) and wpe stay
    assert nvme.nvme_bytes + 8 * on_host == 8 * (part * (4 + 8 + 4) + part * 2)
    assert nvme.host_components["NVMe param swap buffers (host)"] == 5 * 10**8 * 2
    assert "optimizer states (host)" not in nvme.host_components
    # The first NVMe-swapped step builds Adam's states in ordinary host memory before swapping them out; with the
    # states kept on the host (offload=cpu) DeepSpeedCPUAdam steps in place.
    assert nvme.host_components["optimizer-step transient (host)"] == 8 * part
    assert "optimizer-step transient (host)" not in z3.host_components


@pytest.mark.parametrize("n", [1, 2, 3, 4095, 4096, 4097, 123_456_789, 2**31 + 1])
def test_pinned_blocks_are_the_next_power_of_two(n):
    got = M.states.pinned_resident(n)
    assert got >= n and got & (got - 1) == 0 and got < 2 * n


@pytest.mark.heavy
def test_pinned_host_buffers_of_gpu_ranks():
    """What DeepSpeed page-locks on a GPU rank is counted in PyTorch's power-of-two host blocks; Adam's states
    (not pinned), CPU ranks (no page-locking) and offload.pin_memory=false are counted as they are."""
    base = ("+model=gpt2", "zero=stage2", "precision=bf16", "offload=cpu", "launcher.nproc_per_node=1")
    gpu = M.estimate(composed(*base), make_plan(composed(*base), World(1, 1, "cuda")), A100_8)
    plain = M.estimate(composed(*base, "offload.pin_memory=false"),
                       make_plan(composed(*base, "offload.pin_memory=false"), World(1, 1, "cuda")), A100_8)
    cpu = M.estimate(composed(*base), make_plan(composed(*base), World(1, 1, "cpu")), CPU_HOST)
    P = M.count_params(model_file("gpt2"))
    for name, exact in (("fp32 master copies (host)", 4 * P), ("fp32 gradients (host)", 4 * P),
                        ("16-bit param staging (host)", 2 * P)):
        assert gpu.host_components[name] == M.states.pinned_resident(exact) > exact, name
        assert plain.host_components[name] == exact, name
    assert gpu.host_components["optimizer states (host)"] == plain.host_components["optimizer states (host)"] == 8 * P
    assert cpu.host_components["fp32 master copies (host)"] == 4 * P
    # measured on an H200 (benchmarks/results/gpu/h200-2026-11-27): this run's VmHWM was 4,449 MiB
    assert 4_300 < gpu.host_bytes_per_node / 2**20 < 4_449 < plain.host_bytes_per_node / 2**20 + 250


@pytest.mark.heavy
def test_zero3_step_converts_on_the_host_of_a_gpu_rank():
    """ZeRO-3 with the optimizer offloaded and the parameters on the GPU copies each stepped fp32 sub-group
    into the 16-bit partition with one copy_, which converts on the host first: a transient of the sub-group
    in 16 bits (with the parameters offloaded too the copy stays on the host and converts in place)."""
    world = World(1, 1, "cuda")
    plan = lambda c: make_plan(c, world)  # noqa: E731
    opt_only = composed("+model=gpt2", "zero=stage3", "precision=bf16", "offload=cpu", "offload.params=false",
                        "launcher.nproc_per_node=1")
    both = composed("+model=gpt2", "zero=stage3", "precision=bf16", "offload=cpu", "launcher.nproc_per_node=1")
    fp32 = composed("+model=gpt2", "zero=stage3", "precision=fp32", "offload=cpu", "offload.params=false",
                    "launcher.nproc_per_node=1")
    P = M.count_params(model_file("gpt2"))
    assert M.estimate(opt_only, plan(opt_only), A100_8).host_components["optimizer-step transient (host)"] == 2 * P
    for c in (both, fp32):
        assert "optimizer-step transient (host)" not in M.estimate(c, plan(c), A100_8).host_components
    # the page-locked 16-bit partitions zero.Init makes before they move into the flat buffer stay cached
    cached = M.estimate(both, plan(both), A100_8).host_components[M.states.PINNED_CACHE]
    assert 2 * P < cached < 4 * P


def test_peak_is_max_over_phases_not_a_sum():
    e = est("+model=gpt2", "zero=stage2", "precision=bf16", "data.seq_len=1024")
    sums = {k: sum(v.values()) for k, v in e.phases.items()}
    assert e.peak_phase == max(sums, key=sums.get) == "loss"
    assert sum(e.components.values()) == e.per_rank_peak_bytes
    # The optimizer-step transient and the embedding transient are not added to the loss peak.
    assert "optimizer-step transient" not in e.components and "embedding grad transient" not in e.components


@pytest.mark.heavy
def test_golden_gpt2_stage2_bf16():
    """GPT-2 small, ZeRO-2, bf16, 8 × 40 GiB GPUs, micro 4 × seq 512: every term by hand."""
    e = est("+model=gpt2", "zero=stage2", "precision=bf16", "data.seq_len=512", "trainer.micro_batch_size=4")
    P, V, h, a, L, b, s = 124_439_808, 50257, 768, 12, 12, 4, 512
    part = -(-P // 8)  # 15_554_976
    sbh = s * b * h
    # Per layer (CUDA SDPA flash, bf16 = 2 bytes, dropout masks 1 byte, KV-cache copies on):
    #   2 bytes × (LN 2 + QKV in 1 + proj in 1 + fc1 in 1 + fc2 in 4 + GeLU in 4 + q,k,v 3 + K,V copies 2)
    #   (gelu_new runs as PyTorch's fused tanh GeLU, which saves its input: arch.fuse_activations)
    #   + 2 one-byte dropout masks + fp32 log-sum-exp 4·a·s·b + LN stats 2 LNs × (mean, rstd) × 4 bytes
    layer = 2 * 18 * sbh + 2 * sbh + 4 * a * s * b + 2 * 2 * s * b * 4
    outside = sbh + 2 * 2 * sbh + 2 * s * b * 4  # embedding dropout mask; ln_f in + LM-head in; ln_f stats
    loss = {
        "parameters": 2 * P,
        "buffers": L * (1024 * 1024 + 4),
        # No gradients yet: without accumulation DeepSpeed drops them at each step and ZeRO-2 allocates
        # its gradient partition at the first bucket reduce, during backward.
        "fp32 master copies": 4 * part,
        "optimizer states": 8 * part,
        "activations": outside + L * layer,
        "logits + loss": 12 * b * s * V,
        # No reduce bucket either: ZeRO-2 allocates it at the first gradient hook and frees it at the end
        # of every backward.
        "cuBLAS workspaces": 2 * 32 * 2**20,  # cuBLAS's and cuBLASLt's, 32 MiB each on Hopper
    }
    assert dict(e.phases["loss"]) == loss
    assert e.peak_phase == "loss"
    alloc = sum(loss.values())
    # 248,879,616 + 12,582,960 + 62,219,904 + 124,439,808 + 726,679,552 + 1,235,116,032 + 67,108,864
    assert alloc == 2_477_026_736
    # allocator margin (7.5% with expandable segments, zerorun's default on CUDA ranks; measured on an H100),
    # what lives outside the allocator (1,723 MiB measured on an H100), NCCL
    context = 1723 * 2**20
    expected = alloc + int(0.075 * alloc) + context + GIB
    assert e.per_rank_peak_bytes == expected
    fixed = est("+model=gpt2", "zero=stage2", "precision=bf16", "data.seq_len=512", "trainer.micro_batch_size=4",
                "launcher.expandable_segments=false")  # fixed-size segments: the 10% fragmentation prior
    assert fixed.per_rank_peak_bytes == alloc + int(0.10 * alloc) + context + GIB
    assert e.top(3) == [("logits + loss", 12 * b * s * V), ("activations", outside + L * layer), ("parameters", 2 * P)]
    step = e.phases["optimizer step"]
    assert step["optimizer-step transient"] == part * 2 + part * 4  # flat bf16 copy + its fp32 copy (6Ψ/N)
    assert e.phases["embedding grad"]["embedding grad transient"] == 3 * V * h * 2
    assert e.fits and e.device_capacity_bytes == 40 * GIB


@pytest.mark.heavy
def test_bert_classification():
    e = est("+model=bert-base-uncased", "zero=stage2", "precision=bf16", "data.seq_len=512",
            "trainer.micro_batch_size=32")
    assert e.summary["task"] == "sequence_classification" and e.params == 109_483_778
    assert e.phases["loss"]["logits + loss"] == 12 * 32 * 2  # b × num_labels: no vocabulary term
    assert e.peak_phase in ("loss", "backward")
    assert e.phases["embedding grad"]["embedding grad transient"] == 30522 * 768 * 2  # untied: one V×h grad
    five = est("+model=bert-base-uncased", "task.num_labels=5")
    assert five.params == e.params + 3 * 768 + 3
    # ZeRO-3 + CPU offload: param.grad, this rank's slice of reduce_scatter_coalesced's flat output and its fp64
    # copy for the norm are alive at once (8 GPUs: a slice is V·h/8)
    off = est("+model=bert-base-uncased", "zero=stage3", "precision=bf16", "offload=cpu")
    part = -(-30522 * 768 // 8)
    assert off.phases["embedding grad"]["embedding grad transient"] == 30522 * 768 * 2 + part * (2 + 8)


def test_to_json_and_cpu_ranks():
    e = est("+model=tiny-gpt2", "zero=stage2", "offload=cpu", world=CPU2, hw=CPU_HOST)
    assert e.device == "cpu (host RAM)"
    assert e.device_capacity_bytes == 8 * GIB  # host RAM / ranks per node
    assert "CUDA context" not in e.components and "process runtime" in e.components
    assert e.host_bytes_per_node == 2 * e.per_rank_peak_bytes
    assert any(k.endswith("(host)") for k in e.components)  # offloaded state shares the same RAM
    doc = json.loads(json.dumps(e.to_json()))
    assert doc["per_rank_peak_bytes"] == e.per_rank_peak_bytes and doc["fits"] is True
    assert doc["config"]["attention_kernel"] == "sdpa-math"  # CPU SDPA with dropout falls back to math


def test_estimate_is_fast():
    # This process's CPU time, not the wall clock: other jobs on the machine do not move it (the figure itself,
    # ~0.1 ms per estimate, is what zerorun-estimate prints on its last line).
    cfg = composed("+model=gpt2-xl", "zero=stage3")
    t0 = time.process_time()
    for stage in range(4):
        estimate(dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=stage)), GPU8, A100_8)
    assert time.process_time() - t0 < 0.5


# --------------------------------------------------------------------------------------------- gate


LARGE_FP32 = ("+model=gpt2-large", "zero=stage0", "precision=fp32", "data.seq_len=1024", "trainer.micro_batch_size=8",
              "hardware.gpu_mem_gib=16", "hardware.host_mem_gib=256")


@pytest.mark.heavy
@pytest.mark.parametrize("gpus", [1, 8])
def test_gate_strict_refuses_with_top_consumers_and_a_fix(gpus):
    cfg = composed(*LARGE_FP32, f"hardware.gpus_per_node={gpus}")
    hw = resolve_hardware(cfg.hardware, None)
    world = plan_world(cfg, hw)
    assert (hw.gpu_mem_bytes, world.size) == (16 * GIB, gpus)
    d = gate(cfg, world, hw, GateMode.strict)
    assert not d.ok and not d.estimate.fits
    top = d.estimate.top(3)
    assert [k for k, _ in top] == ["activations", "optimizer states", "logits + loss"]
    for name, size in top:
        assert f"{name} {size / GIB:.2f} GiB" in d.message
    assert "16.00 GiB" in d.message
    assert d.suggestion and " ".join(d.suggestion) in d.message
    # The suggested overrides fit. On 1 GPU they shrink the micro-batch and pin the global batch; on 8,
    # ZeRO-1 (optimizer states over 8 ranks) with micro 1, or with checkpointing at fixed-size segments.
    fixed = composed(*LARGE_FP32, f"hardware.gpus_per_node={gpus}", *d.suggestion)
    assert estimate(fixed, world, hw).fits
    if gpus == 1:  # the optimizer to the host, and micro 1 × 8 accumulation steps (as autofit, below)
        assert d.suggestion == ["trainer.micro_batch_size=1", "trainer.global_batch_size=8", "zero=stage1",
                                "offload=cpu"]
    else:  # the fused loss drops the fp32 logits (3 × 8 × 1024 × 50,257 × 4 B), and the speed model ranks micro 2
        # with ZeRO-2 and the optimizer on the host 5% ahead of recomputing micro 8 at ZeRO-1
        assert d.suggestion == ["trainer.micro_batch_size=2", "trainer.global_batch_size=64", "zero=stage2",
                                "offload=cpu", "trainer.fused_loss=true"]
        # Without it (trainer.fused_loss=false: never): ZeRO-1 spreads the optimizer states over 8 ranks; micro 8
        # needs recomputation under the bound, whose GPU terms are priors (context, NCCL, margin) until a GPU
        # calibration measures them
        unfused = gate(composed(*LARGE_FP32, f"hardware.gpus_per_node={gpus}", "trainer.fused_loss=false"), world, hw,
                       GateMode.strict)
        assert unfused.suggestion == ["trainer.activation_checkpointing=true", "zero=stage1"]
        fixed_segments = composed(*LARGE_FP32, f"hardware.gpus_per_node={gpus}", "launcher.expandable_segments=false")
        fixed_gate = gate(fixed_segments, world, hw, GateMode.strict)
        assert fixed_gate.suggestion == d.suggestion
        # Fixed-size segments: a 10% margin prior, not 5%, and as wide: the point and the bound are both higher.
        assert fixed_gate.estimate.per_rank_peak_bytes > d.estimate.per_rank_peak_bytes
        assert fixed_gate.estimate.bound_bytes - fixed_gate.estimate.per_rank_peak_bytes > \
            d.estimate.bound_bytes - d.estimate.per_rank_peak_bytes


@pytest.mark.heavy
@pytest.mark.parametrize("gpus", [1, 8])
def test_autofit_fits_and_keeps_the_global_batch(gpus):
    cfg = composed(*LARGE_FP32, f"hardware.gpus_per_node={gpus}")
    hw = resolve_hardware(cfg.hardware, None)
    world = plan_world(cfg, hw)
    d = gate(cfg, world, hw, GateMode.autofit)
    assert d.ok and d.changes and d.estimate.fits
    assert estimate(d.cfg, world, hw).fits
    assert global_batch(d.cfg, world) == global_batch(cfg, world) == 8 * gpus
    mb = d.cfg.trainer.micro_batch_size
    assert global_batch(d.cfg, world) == mb * grad_accum_steps(d.cfg, world) * world.size
    assert cfg.trainer.micro_batch_size == 8 and cfg.trainer.global_batch_size is None  # input untouched
    assert d.overrides == [c.override() for c in d.changes]
    # The fastest fit under the bound. One 16 GiB GPU cannot partition GPT-2 large's 12.4 GB of fp32 states, and
    # what the GPU holds beyond them (context, margin) leaves too little: the optimizer goes to the CPU, and
    # micro-batch 1 (a 1024-token micro-batch keeps a GPU busy) with the global batch pinned runs faster than
    # recomputing micro-batch 8. On 8, without the logits (the fused loss) micro-batch 2 fits at ZeRO-2 with the
    # optimizer on the host.
    keys = {c.key for c in d.changes}
    if gpus == 1:
        assert keys == {"trainer.micro_batch_size", "trainer.global_batch_size", "zero.stage", "offload.device"}
    else:
        assert keys == {"trainer.micro_batch_size", "trainer.global_batch_size", "zero.stage", "offload.device",
                        "trainer.fused_loss"}


@pytest.mark.heavy
def test_autofit_prefers_micro_batch_then_checkpointing():
    cfg = composed("+model=gpt2", "zero=stage2", "precision=bf16", "data.seq_len=1024", "trainer.micro_batch_size=16",
                   "hardware.gpus_per_node=8", "hardware.gpu_mem_gib=10", "hardware.host_mem_gib=256")
    hw = resolve_hardware(cfg.hardware, None)
    world = plan_world(cfg, hw)
    d = gate(cfg, world, hw, GateMode.autofit)
    assert d.ok
    # Only the micro-batch moves, to the largest one that fits without checkpointing, with the fused loss (no
    # logits), which costs no speed.
    mb = d.cfg.trainer.micro_batch_size
    assert d.overrides == [f"trainer.micro_batch_size={mb}", "trainer.global_batch_size=128", "trainer.fused_loss=true"]
    unfused = gate(composed("+model=gpt2", "zero=stage2", "precision=bf16", "data.seq_len=1024",
                            "trainer.micro_batch_size=16", "hardware.gpus_per_node=8", "hardware.gpu_mem_gib=10",
                            "hardware.host_mem_gib=256", "trainer.fused_loss=false"), world, hw, GateMode.autofit)
    assert unfused.overrides == [f"trainer.micro_batch_size={unfused.cfg.trainer.micro_batch_size}",
                                 "trainer.global_batch_size=128"]
    assert unfused.cfg.trainer.micro_batch_size < mb  # the logits were what held the micro-batch down
    bigger = dataclasses.replace(d.cfg, trainer=dataclasses.replace(d.cfg.trainer, micro_batch_size=2 * mb))
    assert not estimate(bigger, world, hw).fits
    # With less memory still, checkpointing comes in before any ZeRO or offload change.
    tight = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, gpu_mem_gib=6))
    hw = resolve_hardware(tight.hardware, None)
    d = gate(tight, world, hw, GateMode.autofit)
    assert d.ok and "trainer.activation_checkpointing=true" in d.overrides
    assert not [o for o in d.overrides if o.startswith(("zero=", "offload"))]


@pytest.mark.heavy
def test_gate_modes():
    cfg = composed(*LARGE_FP32, "hardware.gpus_per_node=8")
    hw = resolve_hardware(cfg.hardware, None)
    world = plan_world(cfg, hw)
    warn = gate(cfg, world, hw, GateMode.warn)
    assert warn.ok and warn.warning and warn.cfg is cfg
    off = gate(cfg, world, hw, GateMode.off)
    assert off.ok and off.warning is None and off.estimate.per_rank_peak_bytes > 16 * GIB
    small = composed("+model=tiny-gpt2", "hardware.gpus_per_node=8", "hardware.gpu_mem_gib=16")
    fits = gate(small, world, hw)  # cfg.gate is strict by default
    assert fits.ok and fits.mode == GateMode.strict and not fits.changes


@pytest.mark.heavy
def test_gate_refuses_when_nothing_fits():
    cfg = composed("+model=gpt2-xl", "precision=bf16", "data.seq_len=1024", "hardware.gpus_per_node=1",
                   "hardware.gpu_mem_gib=1", "hardware.host_mem_gib=8")
    hw = resolve_hardware(cfg.hardware, None)
    d = gate(cfg, plan_world(cfg, hw), hw, GateMode.autofit)
    assert not d.ok and "no micro-batch" in d.message


def test_resolve_hardware():
    detected = Hardware("cpu", 0, 0, 64 * GIB, 1, 8, fp16_ok=False)
    hw = resolve_hardware(HardwareConfig(gpus_per_node=8, gpu_mem_gib=40), detected)
    assert (hw.accelerator, hw.gpus_per_node, hw.gpu_mem_bytes, hw.host_mem_bytes) == ("cuda", 8, 40 * GIB, 64 * GIB)
    assert resolve_hardware(HardwareConfig(), detected) == detected
    assert not needs_detection(HardwareConfig(gpus_per_node=8, gpu_mem_gib=40))
    assert not needs_detection(HardwareConfig(gpus_per_node=0))
    assert needs_detection(HardwareConfig(gpus_per_node=8))
    hw = resolve_hardware(HardwareConfig(gpus_per_node=4, gpu_mem_gib=80), None, host_mem_bytes=GIB, cpu_cores=3)
    assert (hw.gpus_per_node, hw.host_mem_bytes, hw.cpu_cores, hw.accelerator) == (4, GIB, 3, "cuda")


def test_table_rows_are_valid_combinations():
    from zerorun.config import check

    rows = M.table_configs(composed("+model=gpt2"))
    assert len(rows) == 1 + 2 + 2 + 5
    for _, cfg in rows:
        assert not check(cfg, GPU8, libaio=True), cfg.zero


# --------------------------------------------------------------------------------------------- pipeline


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["tiny-gpt2", "gpt2", "gpt2-xl", "tiny-bert", "bert-base-uncased", "roberta-base"])
def test_pipeline_layer_params_match_deepspeeds_count(name):
    """The layer list and the weights DeepSpeed's _count_layer_params gives zerorun.pipeline's layer specs
    (trainable parameters per spec, the tied embedding at both uses), on a meta-device model."""
    from zerorun.pipeline import pipeline_layers

    m = model_file(name)
    specs = pipeline_layers(meta_model(m), default_task(m.family))
    counted = [sum(p.numel() for p in spec.build().parameters() if p.requires_grad) for spec in specs]
    assert [w for _, w in M.pipeline_layer_params(M.param_breakdown(m))] == counted


@pytest.mark.heavy
def test_partitions_are_deepspeeds():
    import random

    from deepspeed.runtime import utils as ds_utils

    rng = random.Random(0)
    cases = [[rng.randint(0, 50) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    cases += [[w for _, w in M.pipeline_layer_params(M.param_breakdown(model_file(n)))] for n in MODEL_FILES
              if traits(model_file(n)).pipeline]  # the families zerorun.pipeline cuts
    for weights in cases:
        for parts in (1, 2, 3, 4, 8):
            assert M.partition_balanced(weights, parts) == ds_utils.partition_balanced(weights, parts), (weights, parts)
            assert M.partition_uniform(len(weights), parts) == ds_utils.partition_uniform(len(weights), parts)


def pipeline_estimate(*overrides, world=GPU8, hw=A100_8):
    return estimate(composed("parallel=pipeline", *overrides), world, hw)


@pytest.mark.heavy
def test_pipeline_estimate_is_per_stage():
    # gpt2 over 4 stages × 2 data-parallel replicas, 8 micro-batches per step, 1024 tokens.
    e = pipeline_estimate("+model=gpt2", "parallel.stages=4", "trainer.micro_batch_size=2",
                          "trainer.global_batch_size=32", "data.seq_len=1024", "precision=bf16")
    stages = e.stages
    assert [s["in_flight_micro_batches"] for s in stages] == [4, 3, 2, 1]  # 1F1B: the first stage holds most
    bd = M.param_breakdown(model_file("gpt2"))
    assert sum(s["params"] for s in stages) == bd.total + bd.tied_embedding  # the tied wte lives on both ends
    assert sum(s["blocks"] for s in stages) == 12
    assert stages[0]["layers"][:2] == ["wte", "wpe + dropout"] and stages[-1]["layers"][-1] == "lm_head (tied wte)"
    # Logits and the LM loss only on the last stage; the embedding's dense grad only on the ends.
    assert all("logits + loss" not in s["phases"]["loss"] for s in stages[:-1])
    assert stages[-1]["phases"]["loss"]["logits + loss"] == 12 * 2 * 1024 * 50257
    assert all("embedding grad" not in s["phases"] for s in stages[1:-1])
    # The estimate is the worst stage; the gate sees that one.
    worst = max(stages, key=lambda s: s["per_rank_peak_bytes"])
    assert e.per_rank_peak_bytes == worst["per_rank_peak_bytes"] and e.summary["peak_stage"] == worst["stage"]
    assert e.params == bd.total and e.to_json()["pipeline_stages"] == stages
    # Every stage holds a fraction of the model: far below the same job data-parallel at ZeRO-0.
    dp = estimate(composed("+model=gpt2", "trainer.micro_batch_size=2", "trainer.global_batch_size=32",
                             "data.seq_len=1024", "precision=bf16"), GPU8, A100_8)
    assert max(s["model_state_bytes"] for s in stages) < dp.model_state_bytes / 2


@pytest.mark.heavy
def test_pipeline_activations_scale_with_the_stages_in_flight_micro_batches():
    base = ("+model=gpt2", "parallel.stages=2", "parallel.partition=uniform", "trainer.micro_batch_size=1",
            "data.seq_len=512")
    two = pipeline_estimate(*base, "trainer.global_batch_size=8")    # 2 replicas × 4 micro-batches
    one = pipeline_estimate(*base, "trainer.global_batch_size=8", "hardware.gpus_per_node=2",
                            world=World(nproc_per_node=2, nnodes=1, accelerator="cuda"))
    for e in (two, one):
        first = e.stages[0]
        assert first["in_flight_micro_batches"] == 2 and e.stages[1]["in_flight_micro_batches"] == 1
    s0 = two.stages[0]["phases"]["loss"]["activations"]
    # Uniform: 8 of GPT-2's 16 pipeline layers per stage (wte, wpe, 6 blocks first); the first stage keeps
    # 2 micro-batches' activations, each with its output held for the backward.
    act = M.activations(model_file("gpt2"), 1, 512, "fp32", "cuda", False)
    blocks = two.stages[0]["blocks"]
    assert s0 == 2 * (act.outside_first + blocks * act.recompute_layer + act.checkpoint_per_layer)


@pytest.mark.heavy
def test_a_stage_of_embeddings_alone_recomputes_no_layer_in_backward():
    """partition=parameters gives BERT's large word table a stage of its own: its backward has no transformer
    layer to recompute and no layer's gradient working set (tiny BERT's stage 0 read +17% when it had)."""
    e = pipeline_estimate("+model=tiny-bert", "parallel.stages=2", "trainer.activation_checkpointing=true",
                          "trainer.micro_batch_size=12", "data.seq_len=368")
    alone, blocks = e.stages[0], e.stages[1]
    assert alone["blocks"] == 0 and blocks["blocks"] == 2
    assert alone["phases"]["backward"]["activations"] == alone["phases"]["loss"]["activations"]
    assert "activation-grad working set" not in alone["phases"]["backward"]
    assert blocks["phases"]["backward"]["activations"] > blocks["phases"]["loss"]["activations"]
    assert blocks["phases"]["backward"]["activation-grad working set"] > 0


def planned(*overrides):
    """A composed config with the world and hardware it declares (hardware.*)."""
    cfg = composed(*overrides)
    hw = resolve_hardware(cfg.hardware, None)
    return cfg, plan_world(cfg, hw), hw


PIPE_LARGE = ("parallel=pipeline", "+model=gpt2-large", "parallel.stages=2", "trainer.micro_batch_size=8",
              "data.seq_len=1024", "hardware.gpus_per_node=2", "hardware.gpu_mem_gib=16")


@pytest.mark.heavy
def test_gate_refuses_a_pipeline_by_its_worst_stage():
    cfg, world, hw = planned(*PIPE_LARGE, "trainer.global_batch_size=64")
    d = gate(cfg, world, hw, GateMode.strict)
    est = d.estimate
    assert not d.ok and est.stages and not all(s["fits"] for s in est.stages)
    assert f"stage {est.summary['peak_stage']} of 2" in " ".join(est.notes)
    assert f"pipeline stage {est.summary['peak_stage']} of 2 (" in d.message
    fixed = gate(cfg, world, hw, GateMode.autofit)
    assert fixed.ok and all(s["fits"] for s in fixed.estimate.stages)


@pytest.mark.heavy
def test_autofit_keeps_a_pipeline_within_zero1_and_its_micro_batches_consistent():
    cfg, world, hw = planned(*PIPE_LARGE, "parallel.micro_batches=4")
    for cand in _candidates(cfg, world, global_batch(cfg, world)):
        assert cand.stage <= 1 and cand.offload.value == "none"
    d = gate(cfg, world, hw, GateMode.autofit)
    assert d.ok and d.cfg.zero.stage <= 1
    assert global_batch(d.cfg, world) == global_batch(cfg, world) == 32
    if d.cfg.trainer.micro_batch_size != 8:
        assert d.cfg.parallel.micro_batches == grad_accum_steps(d.cfg, world)
    from zerorun.config import check

    assert not [p for p in check(d.cfg, world) if "micro_batches" in str(p)]


def test_estimate_table_for_a_pipeline_lists_its_stages():
    from zerorun.config import check
    from zerorun.estimate_cli import render_table

    cfg, world, hw = planned("parallel=pipeline", "+model=gpt2", "parallel.stages=2", "trainer.global_batch_size=16",
                             "hardware.gpus_per_node=2", "hardware.gpu_mem_gib=16")
    table = M.table_configs(cfg)
    assert [label for label, _ in table] == ["ZeRO-0  offload none", "ZeRO-1  offload none"]
    assert all(not check(c, world, libaio=True) for _, c in table)
    rows = [(label, estimate(c, world, hw), None) for label, c in table]
    text = "\n".join(render_table(cfg, make_plan(cfg, world), hw, rows, "ZeRO-0  offload none"))
    assert "pipeline stages of the composed config (2; the peak above is the worst):" in text
    for st in rows[0][1].stages:
        assert f"stage {st['stage']}: {st['blocks']} block(s) of 12" in text


# --------------------------------------------------------------------------------------------- buckets


@pytest.mark.heavy
def test_zero12_buckets_live_only_in_backward_zero3s_for_the_whole_run():
    bucket = "reduce buckets"
    for stage in (1, 2):
        e = est("+model=gpt2", f"zero=stage{stage}")
        assert bucket not in e.phases["loss"] and bucket not in e.phases["optimizer step"]
        assert e.phases["backward"][bucket] == e.phases["embedding grad"][bucket] == 25 * 2**20  # fp32 grads
    e = est("+model=gpt2", "zero=stage3")
    assert e.phases["loss"][bucket] == e.phases["optimizer step"][bucket] == 25 * 2**20


def test_reduced_before_flushes_when_the_next_gradient_would_overflow():
    from zerorun.memory.buffers import reduced_before

    assert not reduced_before([3, 3, 4], 10)  # exactly full: no reduce yet
    assert reduced_before([3, 3, 5], 10)
    assert not reduced_before([25], 10)  # alone and too large: it goes at the next gradient
    assert reduced_before([25, 1], 10)


@pytest.mark.heavy
def test_gradients_sit_in_a_bucket_that_holds_the_model_until_the_end_of_backward():
    """tiny GPT-2's default bucket holds every gradient: no gradient partition during backward, then one at the
    end next to the bucket; with hidden² buckets the partition is counted from the start (measured both)."""
    whole = est("+model=tiny-gpt2", "zero=stage2", world=CPU2, hw=CPU_HOST)
    small = est("+model=tiny-gpt2", "zero=stage2", "zero.reduce_bucket_size=16384", world=CPU2, hw=CPU_HOST)
    # rank 0's gradient partition holds the word embedding whole (4,096 x 128 elements, more than its 476,928-element
    # share: buffers.zero_partition)
    part = 4096 * 128 * 4
    assert whole.phases["backward"].get("gradients", 0) == 0 and "gradient reduce" in whole.phases
    reduce = whole.phases["gradient reduce"]
    assert reduce["gradients"] == part and reduce["reduce buckets"] == 953_856 * 4
    assert reduce.get("embedding grad transient", 0) == 0  # the word embedding's gradient joined the bucket
    assert small.phases["backward"]["gradients"] == part and "gradient reduce" not in small.phases

"""adapter=qlora: what the rules refuse, and what the gate counts for a 4-bit base (pure; the e2e run is
tests/e2e/test_qlora_runs.py)."""
import pytest

from helpers import A100_8, GPU8, composed, planned
from zerorun import memory as M
from zerorun.config import check
from zerorun.memory.states import QLORA_BYTES

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("overrides, key", [(("zero=stage3",), "adapter.name"),
                                            (("adapter.merge=true",), "adapter.merge"),
                                            (("parallel=pipeline",), "adapter.name")])
def test_what_qlora_refuses_is_one_problem_naming_the_key(overrides, key):
    cfg = composed("+model=tiny-gpt2", "adapter=qlora", *overrides)
    problems = [p for p in check(cfg, GPU8) if p.key == key]
    assert len(problems) == 1 and "qlora" in problems[0].what, [str(p) for p in check(cfg, GPU8)]


def test_the_4bit_base_is_half_a_byte_and_its_scales_per_linear_weight():
    assert QLORA_BYTES == pytest.approx(0.5159, abs=1e-4)  # QLoRA paper: 4 + 0.127 bits
    cfg, plan = planned("+model=llama-3.2-1b", "adapter=qlora", "precision=bf16", "zero=stage2")
    bd = M.param_breakdown(cfg.model, plan.task, 2, cfg.adapter)
    linear = 16 * (2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192)  # q, o, k, v, gate, up, down per layer
    assert bd.quantized == linear
    est = M.estimate(cfg, plan, A100_8)
    expected = (bd.total - linear) * 2 + linear * QLORA_BYTES
    assert est.components["parameters"] == pytest.approx(expected, rel=1e-9)
    lora = M.estimate(*planned("+model=llama-3.2-1b", "adapter=lora", "precision=bf16", "zero=stage2"),
                      A100_8)
    assert lora.components["parameters"] - est.components["parameters"] == pytest.approx(linear * (2 - QLORA_BYTES))
    assert est.per_rank_peak_bytes < lora.per_rank_peak_bytes


def test_the_dequantized_weight_joins_the_working_set():
    qlora = M.estimate(*planned("+model=tiny-llama", "adapter=qlora", "zero=stage2"), A100_8)
    lora = M.estimate(*planned("+model=tiny-llama", "adapter=lora", "zero=stage2"), A100_8)
    assert qlora.summary["adapter"] == "qlora" and lora.summary["adapter"] == "lora"
    assert qlora.per_rank_peak_bytes != lora.per_rank_peak_bytes


def test_autofit_stores_the_base_in_4bit_only_when_allowed():
    from zerorun.config import GateMode
    from zerorun.hardware import GIB, Hardware

    small = Hardware("cuda", 1, 5 * GIB, 64 * GIB, 1, 16)  # LoRA of Llama-3.2-1B does not fit, QLoRA does
    world = __import__("zerorun.config", fromlist=["World"]).World(nproc_per_node=1, nnodes=1, accelerator="cuda")
    base = ("+model=llama-3.2-1b", "adapter=lora", "precision=bf16", "zero=stage2", "trainer.micro_batch_size=1",
            "trainer.activation_checkpointing=true", "data.seq_len=512", "trainer.export=false",
            "trainer.fused_loss=false")  # (with the fused loss LoRA fits: no 128k-vocabulary logits)
    cfg, plan = planned(*base, world=world)
    assert not M.gate(cfg, plan, small, GateMode.autofit).ok
    cfg, plan = planned(*base, "adapter.autofit_qlora=true", world=world)
    decision = M.gate(cfg, plan, small, GateMode.autofit)
    assert decision.ok and "adapter.name=qlora" in " ".join(decision.suggestion or []), decision.message

"""bitsandbytes' CPU inference repack (AVX512-BF16 CPUs) must not touch a QLoRA base: zerorun's validation and
export probe run the model in eval mode without grad, and the repack fails on an input width that is not a
multiple of the quantization block (tiny-llama's down_proj: 352)."""
import pytest
import torch

from zerorun.models import keep_4bit_training_layout

bnb = pytest.importorskip("bitsandbytes")


def down_proj():
    """A 4-bit layer as transformers loads tiny-llama's down_proj (NF4, double quantization, 352 → 128)."""
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(352, 128, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                              quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(128, 352), requires_grad=False, compress_statistics=True,
                                     quant_type="nf4")
    return layer.to("cpu")


def test_an_eval_forward_of_a_4bit_base_keeps_its_layout_and_output():
    model = torch.nn.Sequential(down_proj())
    x = torch.randn(2, 352, dtype=torch.bfloat16)
    model[0].support_avx512bf16_for_cpu = True  # what bitsandbytes sets on a CPU with AVX512-BF16
    with torch.no_grad():
        before = model.train()(x)
    keep_4bit_training_layout(model)
    assert model[0].support_avx512bf16_for_cpu is False
    with torch.no_grad():
        after = model.eval()(x)
    assert not getattr(model[0].weight.quant_state, "packing_format_for_cpu", False)
    assert torch.equal(before, after)


def test_without_it_the_repack_fails_on_a_width_off_the_block():
    """The bug the function works around (bitsandbytes 0.50.2); if this starts passing, the workaround can go."""
    model = torch.nn.Sequential(down_proj())
    model[0].support_avx512bf16_for_cpu = True
    with pytest.raises(RuntimeError, match="invalid for input of size"), torch.no_grad():
        model.eval()(torch.randn(2, 352, dtype=torch.bfloat16))

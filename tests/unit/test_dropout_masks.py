"""trainer.fast_dropout_masks: CPU dropout masks drawn 16 bits at a time, installed as the CPU kernel of
aten::bernoulli_.float, against what a Bernoulli mask must be."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.train import dropout_masks
from zerorun.train.dropout_masks import CHUNK, LEVELS, fill_bernoulli_

pytestmark = pytest.mark.unit


@pytest.fixture
def installed():
    assert dropout_masks.install()
    yield
    dropout_masks.uninstall()


def lanes(n: int, seed=None) -> torch.Tensor:
    """The 16-bit lanes the kernel compares: 64-bit words over int64's whole range, as uniform signed int16s
    (from a generator seeded with ``seed``, else the global one)."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.empty(-(-n // 4), dtype=torch.int64).random_(-2**63, None, generator=generator).view(torch.int16)[:n]


def test_the_lanes_are_uniform_16_bit_draws():
    v = lanes(1 << 20, 0).int() + LEVELS // 2  # 0 .. 65535
    counts = torch.bincount(v >> 8, minlength=256).double()  # the top byte: 256 cells of 4,096 expected
    chi2 = ((counts - 4096) ** 2 / 4096).sum().item()
    assert chi2 < 255 + 6 * math.sqrt(2 * 255)  # chi-square, 255 degrees of freedom: mean 255, sd 22.6
    low = torch.bincount(v & 0xFF, minlength=256).double()  # and the low byte
    assert ((low - 4096) ** 2 / 4096).sum().item() < 255 + 6 * math.sqrt(2 * 255)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), p=st.floats(0, 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), transpose=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_mask_is_the_lanes_below_p_in_place(shape, p, dtype, transpose, seed):
    x = torch.full(shape, 7.0, dtype=dtype)
    if transpose and x.dim() > 1:
        x = x.transpose(0, -1)  # not contiguous: filled through a contiguous copy
    out = fill_bernoulli_(x, p, generator=torch.Generator().manual_seed(seed))
    assert out is x and x.dtype == dtype
    expected = (lanes(x.numel(), seed).int() + LEVELS // 2 < round(p * LEVELS)).to(dtype).view(x.contiguous().shape)
    assert torch.equal(x.contiguous(), expected)


def test_the_mask_is_bernoulli_p_across_chunks():
    n = 5 * CHUNK + 123  # several chunks and a partial one
    for p in (0.0, 1e-7, 0.1, 0.5, 0.9, 1 - 1e-7, 1.0):
        x = fill_bernoulli_(torch.empty(n), p, generator=torch.Generator().manual_seed(3))
        assert set(x.unique().tolist()) <= {0.0, 1.0}
        # within 6 standard deviations of n·p, p to 1/65536
        assert abs(x.sum().item() - n * p) <= 6 * math.sqrt(n * p * (1 - p)) + n / LEVELS, p
        # chunks are independent draws, not one chunk repeated
        if 0.01 < p < 0.99:
            assert not torch.equal(x[:CHUNK], x[CHUNK:2 * CHUNK])


def test_the_probability_is_p_to_a_65536th():
    n = 1 << 22
    for k in (1, 3, 32768, 65535):  # p = k / 65536 exactly: the mean of ~n·p ones
        x = fill_bernoulli_(torch.empty(n), k / LEVELS, generator=torch.Generator().manual_seed(k))
        p = k / LEVELS
        assert abs(x.sum().item() - n * p) <= 6 * math.sqrt(n * p * (1 - p)), k


def test_a_probability_outside_0_1_is_refused_as_torch_refuses_it():
    with pytest.raises(RuntimeError, match="p to be in"):
        fill_bernoulli_(torch.empty(4), 1.5)


def test_installed_it_is_what_dropout_and_sdpa_draw_with_and_a_seed_repeats_it(installed):
    torch.manual_seed(11)
    x = torch.ones(3 * CHUNK)
    y = F.dropout(x, 0.25, training=True)
    torch.manual_seed(11)
    expected = (lanes(3 * CHUNK).int() + LEVELS // 2 < 0.75 * LEVELS).float() / 0.75  # the keep-mask, scaled
    assert torch.allclose(y, expected)
    torch.manual_seed(11)
    assert torch.equal(F.dropout(x, 0.25, training=True), y)  # resume: the same RNG state, the same mask
    q = torch.randn(2, 2, 16, 8)
    assert F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).shape == q.shape
    # autograd: the gradient through dropout is its scaled mask
    x = torch.ones(1000, requires_grad=True)
    torch.manual_seed(5)
    F.dropout(x, 0.5, training=True).sum().backward()
    torch.manual_seed(5)
    assert torch.equal(x.grad, (lanes(1000) < 0).float() * 2)


def test_uninstalled_the_stock_kernel_draws_again(installed):
    torch.manual_seed(2)
    ours = torch.empty(1000).bernoulli_(0.5)
    dropout_masks.uninstall()
    torch.manual_seed(2)
    stock = torch.empty(1000).bernoulli_(0.5)
    assert not torch.equal(ours, stock)  # another random stream: the stock kernel is back
    assert dropout_masks.install() and dropout_masks.install()  # idempotent

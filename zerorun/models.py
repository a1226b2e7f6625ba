"""Hugging Face GPT-2 / BERT / RoBERTa models from a model file: random init from the architecture,
or pretrained weights from a hub name, a local checkpoint directory or a packaged one (pkg://)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List

from .arch import fuse_activations
from .config import DataError, ModelConfig, ModelLoadError, TaskName, UserError


def resolve_pkg_path(spec: str) -> str:
    """pkg://package/sub/dir → the directory inside an installed package (e.g. a bundled checkpoint)."""
    if not spec.startswith("pkg://"):
        return spec
    import importlib.util

    package, _, sub = spec[len("pkg://"):].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise DataError(f"{spec}: Python package '{package}' is not installed.",
                        f"pip install {package.replace('_', '-')}.", key="model.name_or_path", value=spec)
    return str(Path(list(found.submodule_search_locations)[0]) / sub)


def hf_config(m: ModelConfig, num_labels: int = 2):
    """The transformers config for the architecture the model file describes (zerorun/arch)."""
    from transformers import AutoConfig

    from .arch import hf_config_args

    model_type, kwargs = hf_config_args(m, num_labels)
    return AutoConfig.for_model(model_type, **kwargs)


def import_model_code(name: str) -> None:
    """Import a model's transformers modeling code now (``name``: arch.model_code): it is most of a rank's
    non-tensor memory (~150 MB of RSS), and a rank counts it in its baseline before any tensor exists."""
    import importlib

    from .arch.traced import without_unused_extras

    without_unused_extras()
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(name)  # gemma3_text lives in models/gemma3, deberta-v2 in deberta_v2
    importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def model_class(task: TaskName):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if task == TaskName.causal_lm else AutoModelForSequenceClassification


def weights_path(m: ModelConfig) -> str:
    return resolve_pkg_path(m.name_or_path)


def quantization_config(compute_dtype: str):
    """QLoRA's base: NF4 with double quantization (bitsandbytes), computed in the run's precision."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch_dtype(compute_dtype), bnb_4bit_quant_storage=torch.uint8)


def torch_dtype(name: str):
    """The torch dtype of a precision.dtype value (fp32, bf16, fp16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def build_quantized(m: ModelConfig, task: TaskName, num_labels: int, compute_dtype: str, device: str):
    """The base in 4-bit (adapter=qlora). transformers quantizes while loading a checkpoint, so a random init is
    written to a private directory first (every rank makes the same one from the same seed) and loaded from it."""
    import shutil
    import tempfile

    cls = model_class(task)
    kwargs = dict(quantization_config=quantization_config(compute_dtype), device_map={"": device},
                  dtype=torch_dtype(compute_dtype))
    if task != TaskName.causal_lm:
        kwargs["num_labels"] = num_labels
    if m.pretrained:
        try:
            return cls.from_pretrained(weights_path(m), **kwargs)
        except OSError as e:
            raise ModelLoadError(offline_hint(m.name_or_path, e)) from None
    tmp = tempfile.mkdtemp(prefix="zerorun-qlora-init-")
    try:
        cls.from_config(hf_config(m, num_labels)).save_pretrained(tmp, safe_serialization=True)
        model = cls.from_pretrained(tmp, **kwargs)
        model.config._name_or_path = m.name_or_path  # not the directory about to go (peft's export reads it)
        return model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def keep_4bit_training_layout(model):
    """Turn off bitsandbytes' CPU inference repack. On a CPU with AVX512-BF16 (Sapphire Rapids, Zen 4),
    bitsandbytes 0.50 rewrites a 4-bit weight in place into an inference layout the first time the layer runs in
    eval mode without grad (zerorun's validation, the export's logits probe). The rewrite fails on a layer whose
    input width is not a multiple of the 64-value quantization block (tiny-llama's down_proj, 352 wide: "shape
    '[128, 5]' is invalid for input of size 704"), and where it works, training goes on with the weights in another
    layout and kernel than before the evaluation (and than a resumed run)."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
    return model


def build_model(m: ModelConfig, task: TaskName = TaskName.causal_lm, num_labels: int = 2, quantized: str = "",
                device: str = "cpu"):
    """The model to train. Random init is seeded by the caller (same weights on every rank). ``quantized``: the
    compute dtype of a 4-bit base (adapter=qlora)."""
    cls = model_class(task)
    if quantized:
        model = build_quantized(m, task, num_labels, quantized, device)
    elif not m.pretrained:
        model = cls.from_config(hf_config(m, num_labels))
    else:
        try:
            model = cls.from_pretrained(weights_path(m), num_labels=num_labels) if task != TaskName.causal_lm \
                else cls.from_pretrained(weights_path(m))
        except OSError as e:
            raise ModelLoadError(offline_hint(m.name_or_path, e)) from None
    fuse_activations(model)
    keep_4bit_training_layout(model)  # a no-op without 4-bit layers
    # Name the loss explicitly: transformers warns on every forward when the config leaves it unset.
    model.config.loss_type = "ForCausalLM" if task == TaskName.causal_lm else "ForSequenceClassification"
    model.loss_type = model.config.loss_type  # what loss_function reads (from the class name: None for GPT2LMHeadModel)
    return model


def offline_hint(name: str, err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"could not load pretrained weights '{name}' ({first}). Without network access, download it once "
        f"elsewhere (`huggingface-cli download {name}`), copy the directory here and set "
        "model.name_or_path=/path/to/it; or train from random init with model.pretrained=false."
    )


def hub_reachable() -> bool:
    """Whether the hub can be asked at all: not HF_HUB_OFFLINE (read now, not at import), and its host name
    resolves. An offline machine then answers from the local cache at once instead of five retries (~23 s)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    from huggingface_hub import constants

    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname or "huggingface.co", 443)
        return True
    except OSError:
        return False


def pretrained_problems(m: ModelConfig) -> List[UserError]:
    """Before launch: can the weights be found? Empty if yes (or not pretrained), else the actionable problem."""
    if not m.pretrained:
        return []
    key, value = "model.name_or_path", m.name_or_path
    if not m.name_or_path:
        return [UserError(f"model.pretrained=true but model {m.name} names no weights.",
                          "model.name_or_path=<hub name or local checkpoint dir>, or model.pretrained=false.",
                          key=key, value=value)]
    try:
        path = weights_path(m)
    except DataError as e:
        return [e]
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            return [UserError(f"model.name_or_path={m.name_or_path}: no config.json there, so it is not a Hugging "
                              "Face checkpoint.", key=key, value=value)]
        if not any(name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))
                   for name in os.listdir(path)):
            return [UserError(f"model.name_or_path={m.name_or_path}: a config.json but no weights "
                              "(*.safetensors or pytorch_model.bin) to load with model.pretrained=true.",
                              "model.pretrained=false to train it from random init, or the directory the weights "
                              "were saved to.", key="model.pretrained", value=True)]
        return []
    if m.name_or_path.startswith(("/", ".", "pkg://")):
        return [UserError(f"model.name_or_path={m.name_or_path}: no such directory.", key=key, value=value)]
    try:
        from huggingface_hub import hf_hub_download

        hf_hub_download(m.name_or_path, "config.json", local_files_only=not hub_reachable())
        return []
    except Exception as e:  # offline, unknown repo, gated: all mean "not loadable"
        return [ModelLoadError(offline_hint(m.name_or_path, e), key=key, value=value)]


def with_lora(model, m: ModelConfig, adapter, task: TaskName, checkpointing: bool = False):
    """``model`` with LoRA adapters (peft) on the adapter's target modules; everything else frozen (a classifier
    head trains too: peft's SEQ_CLS task keeps it in modules_to_save). A 4-bit base (adapter=qlora) first goes
    through peft's ``prepare_model_for_kbit_training``: the 16-bit weights it keeps (embeddings, norms, head) cast
    to fp32 (DeepSpeed casts them back to the run's precision), and checkpointing as the trainer asks."""
    from peft import LoraConfig, TaskType, get_peft_model, prepare_model_for_kbit_training

    from .arch import lora_targets

    if adapter.name.value == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})

    config = LoraConfig(r=adapter.r, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                        target_modules=list(lora_targets(m, adapter)),
                        task_type=TaskType.CAUSAL_LM if task == TaskName.causal_lm else TaskType.SEQ_CLS)
    return get_peft_model(model, config)

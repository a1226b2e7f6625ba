"""What the baselines share with zerorun's run: the model (the same architecture) and the DeepSpeed JSON a
user would write (DeepSpeed's own defaults, no zerorun tuning)."""
from typing import Any, Dict


def build_model(spec: Dict[str, Any]):
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    if spec["task"] == "causal_lm":
        return GPT2LMHeadModel(GPT2Config(vocab_size=spec["vocab_size"], n_positions=spec["max_positions"],
                                          n_embd=spec["hidden_size"], n_layer=spec["num_layers"],
                                          n_head=spec["num_heads"], n_inner=spec["intermediate_size"]))
    return BertForSequenceClassification(BertConfig(
        vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"], num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"], intermediate_size=spec["intermediate_size"],
        max_position_embeddings=spec["max_positions"], num_labels=2))


def ds_config(spec: Dict[str, Any]) -> Dict[str, Any]:
    zero: Dict[str, Any] = {"stage": spec["zero"]}
    if spec["offload"] != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
        if spec["zero"] == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        "gradient_accumulation_steps": 1,
        # torch's AdamW on CPU ranks, as zerorun picks there (DeepSpeed's FusedAdam is CUDA-only); DeepSpeed's
        # default (FusedAdam) on GPU ranks
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "weight_decay": 0.0,
                                                  "torch_adam": spec["offload"] == "none" and not spec.get("gpus")}},
        "zero_optimization": zero,
        "bf16": {"enabled": spec["dtype"] == "bf16"},
        "steps_per_print": 10**9,
    }

"""Hugging Face GPT-2 / BERT / RoBERTa models as DeepSpeed pipelines, with the same parameters, and back.

layers.py: what travels between stages and the thin wrappers around the model's own submodules;
module.py: the layer list and the PipelineModule; export.py: back to Hugging Face names.
"""
from .export import (export_state_dict, gather_hf_state_dict, merge_state_dicts, release_other_stages,
                     stage_state_dict)
from .layers import (CAUSAL_LM, SEQUENCE_CLASSIFICATION, TASK_OF_CLASS, BertClassifierHeadPipe, EncoderEmbeddingPipe,
                     EncoderLayerPipe, GPT2BlockPipe, GPT2FinalNormPipe, GPT2PositionEmbeddingPipe,
                     GPT2TokenEmbeddingPipe, HFPart, LMHeadPipe, RobertaClassifierHeadPipe, causal_lm_loss,
                     gpt2_lm_head, loss_fn_for, resolve_task, sequence_classification_loss)
from .module import (CHECKPOINTABLE_LAYERS, PARTITION_METHODS, TIED_EMBED_KEY, SequentialPipe, build_pipeline_module,
                     pipeline_layers)

__all__ = [n for n in dir() if not n.startswith("_")]

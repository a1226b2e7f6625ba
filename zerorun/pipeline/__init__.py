"""Hugging Face models as DeepSpeed pipelines, with the same parameters, and back.

layers.py: what travels between stages and the shared layer base; module.py: the layer list (each family's
``PipeRecipe`` in zerorun/arch) and the PipelineModule; export.py: back to Hugging Face names.
"""
from .export import (export_state_dict, gather_hf_state_dict, merge_state_dicts, release_other_stages,
                     stage_state_dict)
from .layers import (CAUSAL_LM, SEQUENCE_CLASSIFICATION, TIED_EMBED_KEY, HFPart, LMHeadPipe, causal_lm_loss,
                     loss_fn_for, sequence_classification_loss)
from .module import (PARTITION_METHODS, SequentialPipe, build_pipeline_module, checkpointable_layers,
                     pipeline_layers, recipes, resolve_task)

__all__ = [n for n in dir() if not n.startswith("_")]

"""The final model in Hugging Face format (weights gathered from every rank or stage), its tokenizer,
and a logits probe: the engine's own output on a fixed input, to check the export against."""
from __future__ import annotations

from typing import Optional

from .trainer import Trainer


def export(trainer: Trainer) -> Optional[str]:
    import torch
    from transformers import AutoTokenizer

    out = trainer.run_dir.export_for(trainer.cfg)
    state_dict = trainer.strategy.state_dict(trainer.hf_model)  # collective; rank 0 gets it
    source = trainer.val_data if len(trainer.val_data) else trainer.train_data
    probe = {k: v for k, v in trainer.batch(source, [0, min(1, len(source) - 1)]).items() if k != "labels"}
    probe = {k: v[:, :32] for k, v in probe.items()}  # input_ids (and attention_mask): 32 tokens is plenty
    trainer.engine.eval()
    with torch.no_grad():
        logits = trainer.strategy.probe_logits(probe, trainer.task)
    trainer.engine.train()
    if trainer.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        model = trainer.strategy.export_model(trainer.hf_model)
        if trainer.cfg.adapter.name.adapts:
            # The adapter (adapter_config.json + adapter_model.safetensors: small) in adapter/; with
            # adapter.merge=true the merged model as a normal Hugging Face checkpoint beside it.
            model.save_pretrained(str(out / "adapter"), safe_serialization=True)
            if trainer.cfg.adapter.merge:
                model.merge_and_unload().save_pretrained(str(out), safe_serialization=True)
        else:
            model.save_pretrained(str(out), state_dict=state_dict, safe_serialization=True)
        AutoTokenizer.from_pretrained(trainer.prepared.tokenizer_dir).save_pretrained(str(out))
        torch.save({"inputs": {k: v.cpu() for k, v in probe.items()}, "task": trainer.task.value, "logits": logits,
                    "dtype": str(next(trainer.engine.module.parameters()).dtype).replace("torch.", "")},
                   out / "probe.pt")
    trainer.dist.barrier()
    return str(out)

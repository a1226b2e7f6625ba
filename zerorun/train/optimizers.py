"""Client optimizers: the ones zerorun builds and hands to deepspeed.initialize (ds_config has no optimizer
section for them). AdamW itself stays DeepSpeed's (ds_config ``optimizer``)."""
from __future__ import annotations

import logging
from typing import Any, Iterable

from ..config import OptimizerImpl, Plan, RunConfig


def build(cfg: RunConfig, plan: Plan, params: Iterable[Any]):
    """The client optimizer of ``plan`` over ``params``, or None (DeepSpeed builds AdamW from ds_config)."""
    tr, opt = cfg.trainer, cfg.optimizer
    if plan.optimizer == OptimizerImpl.bnb_adamw8bit:
        # bitsandbytes logs a warning at import about optional 4-bit CPU kernels zerorun does not use.
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(list(params), lr=tr.lr, betas=tuple(tr.adam_betas), eps=1e-8,
                                   weight_decay=tr.weight_decay, min_8bit_size=opt.min_8bit_size)
    if plan.optimizer == OptimizerImpl.torch_sgd:
        import torch

        return torch.optim.SGD(list(params), lr=tr.lr, momentum=opt.momentum, weight_decay=tr.weight_decay)
    return None

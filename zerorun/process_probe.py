"""What a CPU rank's process holds beyond its tensors on this machine, measured by a real rank (docs/memory.md §5.4).

Two terms of a CPU rank's peak RSS have no tensor behind them, and both move between machines with the same
software: the resident set at "ready" (every import and the process group) and what training adds on top of
the tensors (code the kernels page in, ZeRO's start-up, allocator and Python bookkeeping). On the CI machine
the second was 25-48 MiB larger than on the development machine while the first differed by 13 MiB: every
tiny model read 2-8% under with constants fitted elsewhere. So neither is a constant: before the first
launch of a kind of run on this machine (model code, precision, ZeRO stage, offload, optimizer, adapter,
checkpointing, parallel mode, allocator mode, threads: memory.priors.runtime_overhead_key), one rank (`python -m zerorun.train`, the real rank code) runs a
micro model of the same kind for a few steps with its final evaluation and checkpoint (~10 s). Its "ready"
point is the process baseline; its peak less everything the estimator counts for the micro model is the
runtime overhead added to every model of that kind.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

from .arch import hf_fields, traits
from .arch.config_json import ArchitectureError, micro_fields, traced_fields
from .config import OffloadDevice, ParallelMode, RunConfig, make_plan, plan_world
from .config.rules import mmap_threshold_bytes
from .hardware import Hardware

MICRO = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=128, vocab_size=512)
MICRO_SEQ, MICRO_BATCH, MICRO_ROWS, MICRO_STEPS = 32, 2, 16, 3


def micro_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with a micro model of the same architecture on one rank: every code path a rank of ``cfg`` runs
    (precision, ZeRO stage, offload, optimizer, adapter, checkpointing), tensors of a few hundred KiB. NVMe
    offload runs as CPU offload (its swap files need a real path and size); a pipeline as a one-stage pipeline (the
    same PipelineEngine and optimizer: a bf16 pipeline at ZeRO-0 steps with BF16_Optimizer, data parallel does not);
    tensor parallelism as one data-parallel rank (a shard group needs several)."""
    model = micro_model(cfg.model)
    off = cfg.offload
    if off.device == OffloadDevice.nvme:
        off = dataclasses.replace(off, device=OffloadDevice.cpu, nvme_path="")
    tr = dataclasses.replace(cfg.trainer, max_steps=MICRO_STEPS, micro_batch_size=MICRO_BATCH, global_batch_size=None,
                             warmup_steps=1, save_every=0, eval_every=0, export=False, progress=False, report=False,
                             resume=False, resume_from="", checkpoint_dir="", export_dir="", max_restarts=0)
    la = dataclasses.replace(cfg.launcher, nproc_per_node=1, nnodes=1, node_rank=0, master_addr="127.0.0.1",
                             hostfile="", master_port=None)
    # One rank holds no tensor-parallel group: parallel=tp is measured as the data-parallel rank it is otherwise.
    par = dataclasses.replace(cfg.parallel, stages=1, micro_batches=0, tp_size=1,
                              mode=ParallelMode.dp if cfg.parallel.mode == ParallelMode.tp else cfg.parallel.mode)
    return dataclasses.replace(cfg, model=model, offload=off, trainer=tr, launcher=la, parallel=par,
                               data=dataclasses.replace(cfg.data, seq_len=MICRO_SEQ), dry_run=False)


def micro_model(m):
    """``m`` at micro size: 2 layers, hidden 64, vocabulary 512 (MICRO), the same architecture."""
    grouped = (m.num_kv_heads or m.num_heads) < m.num_heads  # grouped-query attention keeps its K/V sharing
    model = dataclasses.replace(m, **MICRO, max_positions=max(MICRO_SEQ, 64), pretrained=False,
                                from_config_json=False, head_dim=None, num_kv_heads=1 if grouped else None)
    if not traits(m).traced:
        return model
    # A traced model is built from its config.json fields, not the summary above: shrink those, or the micro rank
    # builds two layers of the real widths and vocabulary (qwen3-8b: 1.6 G parameters), and its overhead absorbs
    # what the page-heap term makes of that model's start-up (a config.json Phi-3's kind measured 28 MiB that way,
    # 54 MiB on a micro model; its ranks read -3.8%).
    fields = micro_fields(hf_fields(m), layers=MICRO["num_layers"], hidden=MICRO["hidden_size"],
                          heads=MICRO["num_heads"], inner=MICRO["intermediate_size"], vocab=MICRO["vocab_size"],
                          positions=MICRO_SEQ)
    try:
        summary = traced_fields(m.model_type, {"model_type": m.model_type, **fields}, f"the micro model of {m.name}")
    except ArchitectureError:  # a field of no standard name ties two widths: two layers at the real widths
        return model
    summary["family"] = type(m.family)(summary["family"])
    return dataclasses.replace(model, **summary)


def overhead_key(cfg: RunConfig, hw: Hardware) -> str:
    """The key the gate looks the runtime overhead of ``cfg``'s kind up by (memory.priors.runtime_overhead_key)."""
    from .memory.priors import runtime_overhead_key

    return runtime_overhead_key(cfg, hw, plan_world(cfg, hw, nodes=1).nproc_per_node)


def write_micro_data(cfg: RunConfig, task: str, work: Path):
    """Random token data in the layout the rank reads (data/loader.py), for the micro model."""
    import numpy as np

    from .data.prepare import Prepared

    rng = np.random.default_rng(0)
    vocab = MICRO["vocab_size"]
    paths = {}
    for split in ("train", "val"):
        if task == "causal_lm":
            paths[split] = str(work / f"{split}.npy")
            np.save(paths[split], rng.integers(1, vocab, (MICRO_ROWS, MICRO_SEQ), dtype=np.int64))
        else:
            # One length: each new shape costs bf16 kernels of its own (measured +27 MiB on tiny BERT over
            # 3 steps and an evaluation of 16-32 tokens), which a model's real batches do not repeat at its peak.
            lengths = np.full(MICRO_ROWS, MICRO_SEQ)
            paths[split] = str(work / f"{split}.npz")
            np.savez(paths[split], ids=rng.integers(1, vocab, int(lengths.sum()), dtype=np.int64),
                     offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                     labels=rng.integers(0, cfg.task.num_labels, MICRO_ROWS, dtype=np.int64))
    return Prepared(task=task, train=paths["train"], val=paths["val"], tokenizer_dir="", vocab_size=vocab,
                    num_train=MICRO_ROWS, num_val=MICRO_ROWS, seq_len=MICRO_SEQ, cache_key="micro-probe",
                    longest=0 if task == "causal_lm" else MICRO_SEQ)


def measure(cfg: RunConfig, hw: Hardware, work: Path, cal) -> Dict[str, Any]:
    """Run the micro rank of ``cfg``'s kind in ``work``; its ready point, peak and runtime overhead (bytes)."""
    from omegaconf import OmegaConf

    from . import allocators, launcher
    from .ds_config import render
    from .memory import estimate
    from .memory.priors import RUNTIME_TERM, runtime_overhead_key
    from .rundir import RunDir

    micro = micro_config(cfg)
    plan = make_plan(micro, plan_world(micro, hw, nodes=1))
    work.mkdir(parents=True, exist_ok=True)
    prepared = write_micro_data(micro, plan.task.value, work)
    rd = RunDir(work)
    rd.write_inputs(config_yaml=OmegaConf.to_yaml(OmegaConf.structured(micro)), plan=plan.to_json(),
                    ds_config=render(micro, plan), estimate={}, prepared=prepared.to_json(), resume=None)
    port = launcher.free_port()
    threads = hw.threads_per_rank(plan_world(cfg, hw, nodes=1).nproc_per_node)  # the user's ranks', not the micro's
    env = {**os.environ, **launcher.rank_env("cpu", threads, mmap_threshold_bytes(cfg.launcher.mmap_threshold_mib),
                                             **allocators.rank_env_args(cfg.launcher)),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with open(work / "probe.log", "w") as out:
        rc = subprocess.run([sys.executable, "-m", "zerorun.train", str(work)], env=env, stdout=out,
                            stderr=subprocess.STDOUT, timeout=600, start_new_session=True).returncode
    summary = rd.read_summary()
    if rc != 0 or summary is None:
        raise RuntimeError(f"the micro rank exited {rc}: {(work / 'probe.log').read_text()[-1500:]}")
    row = summary["peak_memory"][0]
    ready, peak = int(row["peak_rss_bytes_by_point"]["ready"]), int(row["peak_rss_bytes"])
    cache = row.get("allocator_cache_bytes")  # tcmalloc's small-object caches: a term of their own, not overhead
    caches = ((runtime_overhead_key(micro, hw, plan.world.nproc_per_node), int(cache)),) if cache else ()
    est = estimate(micro, plan, hw, cal=dataclasses.replace(cal, cpu_process_bytes=ready, process_measured=True,
                                                            corrections=(), allocator_caches=caches))
    counted = est.per_rank_peak_bytes - est.components.get(RUNTIME_TERM, 0)
    # Where the estimator counts more than the micro rank held, the residual is its error on the micro model, not
    # the overhead (a config.json ModernBERT at ZeRO-3 fp32 read 0 that way and its ranks -7%): keep the prior.
    return {"ready_bytes": ready, "peak_bytes": peak, "counted_bytes": counted,
            "overhead_bytes": peak - counted if peak > counted else None, "by_point": row["peak_rss_bytes_by_point"],
            "allocator_cache_bytes": cache}

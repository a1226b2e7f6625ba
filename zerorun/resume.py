"""Where a resumed run starts: the checkpoint trainer.resume finds (damaged ones passed over), the config
changes OOM recoveries of that run made, and a checkpoint saved by another world made loadable (or refused
with the reason)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional, Tuple

from . import checkpoint, launcher, supervise
from .config import OptimizerImpl, ParallelMode, RunConfig, UserError, World, make_plan
from .config.rules import mmap_threshold_bytes
from .rundir import RunDir


def candidates(cfg: RunConfig, run_dir: Path) -> List[Path]:
    """Where trainer.resume looks: trainer.resume_from, else this run dir (hydra.run.dir reused), then
    earlier runs of the same experiment, newest first."""
    if cfg.trainer.resume_from:
        return [Path(cfg.trainer.resume_from)]
    if cfg.trainer.checkpoint_dir:
        return [Path(cfg.trainer.checkpoint_dir)]
    siblings = sorted((d for d in run_dir.parent.iterdir() if d.is_dir() and d != run_dir),
                      key=lambda d: d.name, reverse=True) if run_dir.parent.is_dir() else []
    return [run_dir] + siblings


def find(cfg: RunConfig, world: World, run_dir: RunDir, say: Callable[[str], None]
         ) -> Tuple[RunConfig, Optional[dict]]:
    """With trainer.resume: the newest complete checkpoint whose files match their manifest (damaged ones
    are named and passed over), and the config changes OOM recoveries of that run made, applied again."""
    tr = cfg.trainer
    if not (tr.resume or tr.resume_from):
        guard_earlier_checkpoints(cfg, run_dir, say)
        return cfg, None
    found, skipped = checkpoint.resume_point(candidates(cfg, run_dir.path))
    for why in skipped:
        say(f"passing over a damaged checkpoint: {why}")
    if not found:
        if skipped:
            raise UserError(f"no checkpoint to resume from is intact: {skipped[-1]}.",
                            "restore the file, resume_from an earlier run, or drop trainer.resume to start over.",
                            key="trainer.resume_from")
        if tr.resume_from:  # named: the user believes it is there, so starting over would mislead them
            raise UserError(f"trainer.resume_from={tr.resume_from}: no complete checkpoint was found there.",
                            "name a run dir or checkpoint dir holding a complete checkpoint (a global_stepN with "
                            "COMPLETE), or drop trainer.resume_from to start over.", key="trainer.resume_from",
                            value=tr.resume_from)
        # The requeue idiom: `trainer.resume=true` on every submission, the first one has nothing yet.
        say(f"trainer.resume=true: no complete checkpoint in {run_dir.path} or earlier runs of {cfg.name}: "
            "starting from step 0")
        return cfg, None
    root, tag = found
    source = root.parent if root.name == "checkpoints" else root
    refuse_another_model(cfg, root, tag, source)
    say(f"resuming from {root / tag}")
    changes = supervise.recorded_changes(source)
    if changes:
        cfg = supervise.apply_changes(cfg, changes)
        say("applying what out-of-memory recoveries of that run changed: " + " ".join(c["override"] for c in changes))
        if source.resolve() != run_dir.path.resolve():
            for event in RunDir(source).read_recoveries():
                run_dir.append_recovery({**event, "run_dir": str(source)})
    resume = {"checkpoint_dir": str(root.resolve()), "tag": tag}
    return cfg, for_this_world(cfg, world, root, tag, resume, run_dir, say)


def refuse_another_model(cfg: RunConfig, root: Path, tag: str, source: Path) -> None:
    """A checkpoint of another model (architecture, adapter or task) is refused before launch, naming both; what
    it is comes from its COMPLETE marker, else from the config.yaml of the run dir that saved it."""
    saved = checkpoint.marker(root, tag).get("run")
    if saved is None and RunDir(source).file("config.yaml").is_file():
        try:
            saved = checkpoint.identity(RunDir(source).read_config())
        except Exception:  # noqa: BLE001 (a config of an older zerorun: nothing to compare)
            saved = None
    why = checkpoint.identity_mismatch(saved or {}, checkpoint.identity(cfg))
    if why:
        key = "trainer.resume_from" if cfg.trainer.resume_from else "trainer.resume"
        raise UserError(f"{key}: {root / tag} is a checkpoint of another model, {why}.",
                        f"resume with the model it was saved with (+model={(saved or {}).get('model', '...')}), "
                        f"resume from a run of {cfg.model.name}, or drop {key} to start over.", key=key,
                        value=cfg.trainer.resume_from or True)


def guard_earlier_checkpoints(cfg: RunConfig, run_dir: RunDir, say: Callable[[str], None]) -> None:
    """A fresh run into a dir that holds an earlier run's complete checkpoints would overwrite them: refused
    (exit 2) unless trainer.overwrite=true, which deletes them first (HF Trainer's output_dir guard)."""
    root = run_dir.checkpoints_for(cfg)
    tags = checkpoint.complete_tags(root)
    if not tags:
        return
    if not cfg.trainer.overwrite:
        raise UserError(f"{root} already holds {len(tags)} complete checkpoint(s) of an earlier run (newest "
                        f"{tags[-1]}), and this run would overwrite them.",
                        "trainer.resume=true to continue that run, or a new hydra.run.dir (or "
                        "trainer.checkpoint_dir), or trainer.overwrite=true to delete them and start over.",
                        key="trainer.resume", value=False)
    if not cfg.dry_run:
        import shutil

        say(f"trainer.overwrite=true: deleting the earlier run's checkpoints in {root} ({', '.join(tags)})")
        shutil.rmtree(root)


def for_this_world(cfg: RunConfig, world: World, root: Path, tag: str, resume: dict, run_dir: RunDir,
                   say: Callable[[str], None] = print) -> dict:
    """A checkpoint saved by another number of data-parallel ranks: ZeRO-0 holds the whole optimizer and
    loads as is; ZeRO ≥ 1 shards it, so it is converted to DeepSpeed's universal format first (once)."""
    saved = checkpoint.marker(root, tag)
    family = lambda impl: "adamw" if impl in ("fused_adam", "cpu_adam", "torch_adamw") else impl  # noqa: E731
    plan = make_plan(cfg, world)
    was, now_opt = saved.get("world", {}).get("optimizer"), plan.optimizer.value
    if was and family(was) != family(now_opt):
        name = {"bnb_adamw8bit": "adamw8bit", "torch_sgd": "sgd"}.get(was, "adamw")
        raise UserError(f"the checkpoint {root / tag} holds {family(was)} optimizer states and this run uses "
                        f"{family(now_opt)}: they cannot be loaded into each other.",
                        f"resume with the optimizer it was saved with (optimizer={name}), or drop trainer.resume "
                        "to start over.", key="optimizer.name", value=cfg.optimizer.name.value)
    then = saved.get("world", {}).get("data_parallel")
    now = plan.data_parallel_size
    tp_was, tp_now = saved.get("world", {}).get("tensor_parallel", 1), plan.tensor_parallel
    if tp_was != tp_now or (tp_now > 1 and then and then != now):
        # Each model-states file holds one tensor-parallel shard; DeepSpeed's universal conversion does not reshard
        # AutoTP layers into another degree, and zerorun has not run it across data-parallel sizes with AutoTP.
        was = f"parallel=tp parallel.tp_size={tp_was}" if tp_was > 1 else "parallel=" + ("dp" if then else "?")
        raise UserError(f"the checkpoint {root / tag} was saved with tensor parallelism {tp_was} × {then} data-parallel "
                        f"ranks and this run has {tp_now} × {now}: tensor-parallel checkpoints resume only on the "
                        "layout that saved them.", f"resume with {was} on {saved.get('world', {}).get('ranks', '?')} "
                        "ranks (as saved), or drop trainer.resume to start over.",
                        key="parallel.tp_size", value=cfg.parallel.tp_size)
    if not then or then == now:
        return resume
    if was == OptimizerImpl.bnb_adamw8bit.value and saved.get("zero_stage", 0):
        raise UserError(f"the checkpoint {root / tag} was saved by {then} data-parallel ranks with 8-bit optimizer "
                        f"states and this run has {now}: DeepSpeed's universal checkpoint slices every state tensor "
                        "as if it were shaped like the parameters, and the 8-bit states' block scales are not.",
                        f"resume on {then} data-parallel ranks (launcher.nproc_per_node × launcher.nnodes, as saved).",
                        key="optimizer.name", value="adamw8bit")
    if cfg.launcher.node_local_run_dirs:
        raise UserError(f"the checkpoint {root / tag} was saved by {then} data-parallel ranks and this run has {now}; "
                        "converting it needs every node's shards in one place, and each node holds only its own.",
                        f"copy each node's {tag} into one directory, resume there with "
                        f"trainer.resume_from=<that run dir>, or keep {then} data-parallel ranks",
                        key="launcher.shared_run_dir", value=False)
    if cfg.parallel.mode == ParallelMode.pipeline:
        raise UserError(f"the checkpoint {root / tag} was saved by {then} data-parallel ranks and this run has {now}; "
                        "pipeline checkpoints resume only on the same layout.",
                        f"launcher.nproc_per_node={saved.get('world', {}).get('ranks', then)} (as saved)",
                        key="launcher.nproc_per_node", value=world.nproc_per_node)
    batch_was, batch_now = saved.get("world", {}).get("global_batch"), plan.global_batch_size
    if batch_was and batch_was != batch_now:
        say(f"warning: the global batch was {batch_was} and is now {batch_now}: "
            f"trainer.global_batch_size={batch_was} keeps the optimization (and the data order) the same.")
    if saved.get("zero_stage", 0) == 0:
        say(f"the checkpoint was saved by {then} data-parallel ranks, this run has {now}: ZeRO-0 checkpoints "
            "hold the whole optimizer state and load as they are.")
        return resume
    say(f"the checkpoint was saved by {then} data-parallel ranks, this run has {now}: converting it to "
        "DeepSpeed's universal checkpoint format (deepspeed.checkpoint.ds_to_universal, once) ...")
    try:
        out = checkpoint.to_universal(root, tag, run_dir.path / checkpoint.UNIVERSAL,
                                      launcher.rank_env(world.accelerator, 1, mmap_threshold_bytes(cfg.launcher.mmap_threshold_mib)))
    except RuntimeError as e:
        raise UserError(str(e), f"convert it yourself: python -m deepspeed.checkpoint.ds_to_universal --input_folder "
                        f"{root / tag} --output_folder {run_dir.path / checkpoint.UNIVERSAL / tag} "
                        "--inject_missing_state", key="trainer.resume_from") from e
    say(f"converted: resuming from {out / tag} (checkpoint.load_universal)")
    return {"checkpoint_dir": str(out.resolve()), "tag": tag, "universal": True, "converted_from": str(root / tag)}

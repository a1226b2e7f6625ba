"""``zerorun``: compose → check → prepare data → estimate → gate → render → write run dir → launch.

A thin Hydra app over the library: every decision is a pure function elsewhere; this module
only orders them and performs the side effects (files, the launch).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import hydra
from omegaconf import DictConfig, OmegaConf

from . import checkpoint, launcher
from .config import ConfigError, RunConfig, check, global_batch, grad_accum_steps, register_schemas, \
    to_run_config, unknown_override_keys, resolved_task, plan_world
from .ds_config import render
from .hardware import GIB, detect
from .memory import gate as memory_gate, resolve_hardware

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def say(msg: str) -> None:
    print(f"zerorun: {msg}", file=sys.stderr, flush=True)


def refuse(problems: List[str]) -> int:
    """Print every problem (one line each) and return the bad-input exit code; nothing launched."""
    if len(problems) == 1:
        say(f"error: {problems[0]}")
    else:
        say(f"error: {len(problems)} problems in the config:")
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
    say("nothing was launched.")
    return EXIT_BAD_INPUT


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _resume_candidates(cfg: RunConfig, run_dir: Path) -> List[Path]:
    if cfg.trainer.resume_from:
        return [Path(cfg.trainer.resume_from)]
    # This run dir first (hydra.run.dir reused), then earlier runs of the same experiment, newest first.
    siblings = sorted((d for d in run_dir.parent.iterdir() if d.is_dir() and d != run_dir),
                      key=lambda d: d.name, reverse=True) if run_dir.parent.is_dir() else []
    return [run_dir] + siblings


@dataclass
class Outcome:
    """What one composed config led to (a multirun sweep collects one per point)."""

    run_dir: str
    code: int
    status: str
    notes: List[str] = field(default_factory=list)


def launch(raw: DictConfig, run_dir: Path) -> Outcome:
    """The whole pipeline for one config. Returns an exit code; raises nothing a user caused."""
    from .data import DataError, prepare
    from .models import check_pretrained_available

    try:
        cfg = to_run_config(raw)
    except ConfigError as e:
        return Outcome(str(run_dir), refuse(e.problems), "bad-config")
    except Exception as e:  # an unknown key added with '+', a wrong type: OmegaConf's message names the key
        return Outcome(str(run_dir), refuse([str(e).splitlines()[0] + " Fix: check the key's spelling (zerorun --cfg job shows them all)."]), "bad-config")
    hw = detect()
    world = plan_world(cfg, hw, nodes=cfg.launcher.nnodes)
    problems = check(cfg, world)
    pretrained = check_pretrained_available(cfg.model)
    if pretrained:
        problems.append(pretrained)
    if problems:
        return Outcome(str(run_dir), refuse(problems), "bad-config")

    say(hw.describe())
    # Declared hardware.* sizes plan for a cluster you are not on; they feed the gate only, so a CPU
    # box never launches CUDA ranks because a GPU size was declared.
    plan_hw = resolve_hardware(cfg.hardware, hw)
    gate_world = plan_world(cfg, plan_hw)
    if gate_world.size != world.size or plan_hw.accelerator != world.accelerator:
        say(f"memory gate plans for the declared hardware: {plan_hw.describe()}, {gate_world.size} rank(s); "
            f"this machine launches {world.size} {world.accelerator} rank(s).")
    decision = memory_gate(cfg, gate_world, plan_hw)
    est = decision.estimate
    if not decision.ok:
        return Outcome(str(run_dir), refuse([f"memory: {decision.message}"]), "memory")
    if decision.warning:
        say(f"warning: memory: {decision.warning}")
    if decision.changes:
        cfg = decision.cfg
        problems = check(cfg, world)
        if problems:
            return Outcome(str(run_dir), refuse(problems), "bad-config")
        say(f"memory: {decision.message}")
    if est is not None:
        say(f"memory: {est.per_rank_peak_bytes / GIB:.2f} of {est.device_capacity_bytes / GIB:.2f} GiB per "
            f"{'GPU' if est.device == 'cuda' else 'rank'} (peak in {est.peak_phase}; largest: "
            + ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.top(3)) + f") [gate={decision.mode.value}]")
    accum = grad_accum_steps(cfg, world)
    gb = global_batch(cfg, world)
    say(f"{cfg.model.name} ({'pretrained ' + cfg.model.name_or_path if cfg.model.pretrained else 'random init'}) · "
        f"ZeRO-{cfg.zero.stage} · offload {cfg.offload.device.value} · {cfg.precision.dtype.value} · "
        f"{world.size} rank(s) via {cfg.launcher.name.value}")
    say(f"batch: micro {cfg.trainer.micro_batch_size} × accum {accum} × {world.size} ranks = global {gb} sequences "
        f"× {cfg.data.seq_len} tokens = {gb * cfg.data.seq_len} tokens per step, {cfg.trainer.max_steps} steps")

    try:
        prepared = prepare(cfg.data, cfg.model, cfg.seed, resolved_task(cfg).value, cfg.task.num_labels)
    except DataError as e:
        return Outcome(str(run_dir), refuse([str(e)]), "bad-data")
    say(f"data: {prepared.source}, {resolved_task(cfg).value}: {prepared.num_train} train / {prepared.num_val} "
        f"validation {'blocks of' if prepared.task == 'causal_lm' else 'examples up to'} {prepared.seq_len} tokens"
        f"{' (cached)' if prepared.cached else ''}; tokenizer vocab {prepared.vocab_size}")

    resume = None
    if cfg.trainer.resume:
        found = checkpoint.find_resume_point(_resume_candidates(cfg, run_dir))
        if not found:
            where = cfg.trainer.resume_from or f"{run_dir} or earlier runs in {run_dir.parent}"
            return Outcome(str(run_dir), refuse([f"trainer.resume=true but no complete checkpoint was found in {where}. "
                                                 "Fix: trainer.resume_from=<run dir>, or drop trainer.resume."]),
                           "bad-config")
        resume = {"checkpoint_dir": str(found[0].resolve()), "tag": found[1]}
        say(f"resuming from {found[0] / found[1]}")

    nvme_path = cfg.offload.nvme_path or str(run_dir / "nvme_swap")
    ds = render(cfg, world, nvme_path=nvme_path)

    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.offload.device.value == "nvme":
        os.makedirs(nvme_path, exist_ok=True)
    # Atomic writes: with a shared run dir every node's zerorun writes the same files, and a rank
    # must never read a half-written one.
    write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    write_atomic(run_dir / "ds_config.json", json.dumps(ds, indent=2) + "\n")
    write_atomic(run_dir / "estimate.json", json.dumps({**(est.to_json() if est else {}), "gate": {
        "mode": decision.mode.value, "ok": decision.ok, "message": decision.message,
        "changes": [dataclasses.asdict(c) for c in decision.changes]}}, indent=2, default=str) + "\n")
    write_atomic(run_dir / "prepared.json", json.dumps(prepared.to_json(), indent=2))
    if resume:
        write_atomic(run_dir / "resume.json", json.dumps(resume, indent=2))
    elif (run_dir / "resume.json").exists():
        (run_dir / "resume.json").unlink()

    plan = launcher.LaunchPlan(
        launcher=cfg.launcher.name.value, run_dir=str(run_dir.resolve()), nproc_per_node=world.nproc_per_node,
        accelerator=world.accelerator, nnodes=cfg.launcher.nnodes, node_rank=cfg.launcher.node_rank,
        master_addr=cfg.launcher.master_addr, master_port=cfg.launcher.master_port or launcher.free_port(),
        hostfile=cfg.launcher.hostfile, threads_per_rank=max(1, hw.cpu_cores // world.nproc_per_node),
        bin_dir=launcher.default_bin_dir(),
    )
    argv, env = launcher.build_command(plan)
    line = launcher.shell_line(argv, env)
    write_atomic(run_dir / "command.sh", "#!/usr/bin/env bash\n" + line + "\n")
    say(f"run dir: {run_dir}")
    say(f"command: {line}")
    if cfg.dry_run:
        say("dry run: nothing launched.")
        return Outcome(str(run_dir), EXIT_OK, "dry-run")

    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary_path.unlink()
    rc = launcher.run(argv, env)
    if world.accelerator == "cpu":  # the ranks unlink theirs; this catches ranks that died
        launcher.release_cpu_shm(plan.master_addr, plan.master_port)
    if rc == 0 and not summary_path.exists():
        # The deepspeed CLI can exit 0 when a rank died without a trace; success is the summary.
        say("the launcher exited 0 but no rank wrote summary.json: treating the run as failed.")
        rc = EXIT_FAILED
    if rc != 0:
        say(f"training failed (exit code {rc}); the failing rank's error is above. Run dir: {run_dir}")
        return Outcome(str(run_dir), rc, "failed")
    return Outcome(str(run_dir), EXIT_OK, "completed")


# ---------------------------------------------------------------------------------------------
# Hydra wiring

_state = {"task_started": False, "outcomes": []}


@hydra.main(version_base=None, config_path="pkg://zerorun.conf", config_name="config")
def _hydra_app(raw: DictConfig) -> int:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    _state["task_started"] = True
    hc = HydraConfig.get()
    outcome = launch(raw, Path(hc.runtime.output_dir))
    _state["outcomes"].append(outcome)
    if hc.mode == RunMode.MULTIRUN:
        what = {"memory": "skipped, does not fit (memory gate)", "bad-config": "skipped, bad config",
                "bad-data": "skipped, bad data", "failed": f"failed (exit code {outcome.code})"}
        say(f"sweep point {hc.job.num} ({hc.job.override_dirname or 'defaults'}): "
            f"{what.get(outcome.status, outcome.status)}")
        return outcome.code
    if outcome.code != 0:
        sys.exit(outcome.code)
    return 0


def main() -> None:
    register_schemas()
    typos = unknown_override_keys(sys.argv[1:])
    if typos:
        sys.exit(refuse(typos))
    try:
        _hydra_app()
    except SystemExit as e:
        # Hydra exits 1 on its own composition errors (unknown group option, key typo): ours is 2.
        if e.code == 1 and not _state["task_started"]:
            sys.exit(EXIT_BAD_INPUT)
        raise
    outcomes: List[Outcome] = _state["outcomes"]
    if len(outcomes) > 1 or (outcomes and outcomes[0].status not in ("completed", "dry-run")):
        failed = [o for o in outcomes if o.status == "failed"]
        say(f"sweep: {len(outcomes)} points: " + ", ".join(
            f"{s} {sum(o.status == s for o in outcomes)}" for s in sorted({o.status for o in outcomes})))
        if failed:
            sys.exit(max(o.code for o in failed) or EXIT_FAILED)
        if all(o.code == EXIT_BAD_INPUT for o in outcomes):
            sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()

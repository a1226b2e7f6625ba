"""``zerorun``: compose → check → gate → plan → prepare data → render → write run dir → launch.

A thin Hydra app over the library: every decision is a pure function elsewhere; this module only
orders them and performs the side effects (files, the launch). Anything the user caused surfaces
as a zerorun.config.UserError: one clear line (or one per problem), exit 2, nothing launched.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import hydra
from omegaconf import DictConfig, OmegaConf

from . import allocators, checkpoint, faults, launcher, netcheck, platforms, quiet, speed, supervise
from .config import (Allocator, ConfigError, DataError, GateMode, Monitor, OffloadDevice, Plan, Rendezvous, RunConfig,
                     UserError, World, check, compose, make_plan, plan_world, register_schemas, to_run_config,
                     unknown_group_choices, unknown_override_keys)
from .config.load import hydra_words_problem
from .config.rules import mmap_threshold_bytes
from .hardware import GIB, Hardware, detect, resolve_hardware
from .resume import find as resume_point
from .rundir import RunDir

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = faults.EXIT_OK, faults.EXIT_FAILED, faults.EXIT_BAD_INPUT


def say(msg: str) -> None:
    print(f"zerorun: {msg}", file=sys.stderr, flush=True)


def refuse(error: UserError) -> int:
    """Print every problem (one line each) and return the bad-input exit code; nothing launched."""
    problems = error.problems if isinstance(error, ConfigError) else [error]
    _state["why"] = _state.get("why") or str(problems[0])
    if len(problems) == 1:
        say(f"error: {problems[0]}")
    else:
        say(f"error: {len(problems)} problems in the config:")
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
    say("nothing was launched.")
    return EXIT_BAD_INPUT


def _status(error: UserError) -> str:
    if isinstance(error, DataError):
        return "bad-data"
    return "memory" if error.key == "gate" else "bad-config"


@dataclass
class Outcome:
    """What one composed config led to (a multirun sweep collects one per point)."""

    run_dir: str
    code: int
    status: str
    notes: List[str] = field(default_factory=list)
    """Why it did not run (a refusal's one line)."""
    point: int = 0
    overrides: List[str] = field(default_factory=list)


def launch(raw: DictConfig, run_dir: Path) -> Outcome:
    """The whole pipeline for one config; never raises for what a user caused."""
    quiet.quiet_libraries(bool(raw.get("verbose", False)))
    try:
        return _launch(raw, RunDir(run_dir))
    except UserError as e:
        return Outcome(str(run_dir), refuse(e), _status(e), notes=[str(e).splitlines()[0]])


def checked(cfg: RunConfig, world: World, *, weights: bool = True) -> RunConfig:
    """``cfg`` when ``check`` finds nothing (and, with ``weights``, its pretrained weights can be found),
    else every problem at once."""
    from .models import pretrained_problems

    problems = check(cfg, world) + (pretrained_problems(cfg.model) if weights else [])
    if problems:
        raise ConfigError(problems)
    return cfg


def _heap_ceiling_note(cfg: RunConfig, world: World, alloc) -> str:
    """The allocator line's word on the ceiling CPU ranks put on their tcmalloc heap (train/heap_limit.py)."""
    from .train import heap_limit

    n = cfg.launcher.heap_limit_mib
    if not heap_limit.applies(n, world.accelerator, alloc.name):
        return ""
    held = "each rank's share of host RAM" if n < 0 else f"{n} MiB"
    return f"; heap held under {held} (launcher.heap_limit_mib)"


def gated(cfg: RunConfig, world: World, hw: Hardware, prepared, run_dir: RunDir):
    """The memory gate on the hardware to plan for (``hardware.*`` declared, else this machine):
    (the config to launch, the decision). Declared sizes feed the gate only, so a CPU box never launches
    CUDA ranks because a GPU size was declared. Corrections measured on this machine apply when the plan
    is for this machine (``gate=calibrate`` measures one first)."""
    from . import calibration
    from .memory import gate, resolve_mmap_threshold

    plan_hw = resolve_hardware(cfg.hardware, hw)
    here = plan_hw.device_name == hw.device_name and plan_hw.accelerator == hw.accelerator
    # Before the baseline probe: it measures the allocator the ranks will run.
    cfg, alloc = allocators.with_allocator(cfg, world.accelerator)
    if world.accelerator == "cpu" or alloc.name != Allocator.glibc:
        glibc_mmap = world.accelerator == "cpu" and alloc.name == Allocator.glibc and cfg.launcher.mmap_threshold_mib is None
        say(("CPU ranks' allocator: " if world.accelerator == "cpu" else "allocator: ") + alloc.why
            + ("; mmap threshold 1 MiB (freed activations go back to the OS)" if glibc_mmap else "")
            + _heap_ceiling_note(cfg, world, alloc))
    if here and not cfg.dry_run and cfg.gate != GateMode.off:
        from .process_probe import micro_config

        ensure_ops(micro_config(cfg), world.accelerator)  # what the micro rank loads
        calibration.ensure_baseline(cfg, hw, log=say)
    cal = calibration.calibration_for(cfg, hw if here else None)
    gate_world = plan_world(cfg, plan_hw)
    if cfg.launcher.mmap_threshold_mib is None:  # auto: the validated memory-saving setting
        cfg = resolve_mmap_threshold(cfg, make_plan(cfg, gate_world, prepared.longest), plan_hw, cal)
    if cfg.gate == GateMode.calibrate:
        if plan_hw.device_name != hw.device_name:
            say("gate=calibrate measures this machine, but hardware.* plans for another: gating with priors.")
        elif calibration.has_correction(cfg, hw, cal) is None:
            ensure_ops(cfg, world.accelerator)
            record = calibration.probe(cfg, hw, prepared, run_dir.path / "calibration", log=say)
            say(f"calibrated in {record['seconds']:.0f} s: {record['measure']} {record['measured_bytes'] / GIB:.2f} GiB "
                f"measured, {record['estimated_bytes'] / GIB:.2f} GiB estimated; the correction "
                f"({record['correction_bytes'] / 2**20:+.0f} MiB) applies from now on (calibration.json).")
            cal = calibration.calibration_for(cfg, hw)
    if gate_world.size != world.size or plan_hw.accelerator != world.accelerator:
        say(f"memory gate plans for the declared hardware: {plan_hw.describe()}, {gate_world.size} rank(s); "
            f"this machine launches {world.size} {world.accelerator} rank(s).")
    decision = gate(cfg, make_plan(cfg, gate_world, prepared.longest), plan_hw, cal=cal)
    if not decision.ok:
        raise decision.refusal()
    if decision.warning:
        say(f"warning: memory: {decision.warning}")
    if decision.changes:
        cfg = checked(decision.cfg, world, weights=False)
        say(f"memory: {decision.message}")
    est = decision.estimate
    say(f"memory: {est.per_rank_peak_bytes / GIB:.2f}, at most {est.bound_bytes / GIB:.2f}, of "
        f"{est.device_capacity_bytes / GIB:.2f} GiB per "
        f"{'GPU' if est.device == 'cuda' else 'rank'} (peak in {est.peak_phase}; largest: "
        + ", ".join(f"{k} {v / GIB:.2f}" for k, v in est.top(3)) + f") [gate={cfg.gate.value}; {est.calibration}]")
    return cfg, decision


def ensure_ops(cfg: RunConfig, accelerator: str) -> None:
    """DeepSpeed's JIT ops that ranks of ``cfg`` load, built now if they are not (a line each), so no rank
    compiles in silence; a few stat calls when they are. Dry runs build nothing."""
    from . import ops

    if not cfg.dry_run:
        ops.ensure(ops.needed_for(cfg, accelerator), accelerator, log=say)


def _launch(raw: DictConfig, run_dir: RunDir) -> Outcome:
    from .data import prepare

    cfg = to_run_config(raw)
    hw = detect()
    world = plan_world(cfg, hw, nodes=cfg.launcher.nnodes)
    cfg = checked(cfg, world)
    say(hw.describe())
    prepared = prepare(cfg.data, cfg.model, cfg.seed, make_plan(cfg, world).task.value, cfg.task.num_labels)
    say(f"data: {prepared.source}, {prepared.task}: {prepared.num_train} train / {prepared.num_val} "
        f"validation {'blocks of' if prepared.task == 'causal_lm' else 'examples up to'} "
        f"{prepared.longest or prepared.seq_len} tokens"
        f"{' (cached)' if prepared.cached else ''}; tokenizer vocab {prepared.vocab_size}")
    cfg, resume = resume_point(cfg, world, run_dir, say)
    first = _prepare(cfg, world, hw, prepared, run_dir, resume)
    la = cfg.launcher
    if la.node_by_node:  # the rendezvous, checked in seconds
        serves = netcheck.is_local(la.master_addr) if la.rdzv == Rendezvous.c10d else la.node_rank == 0
        problem = netcheck.port_problem(first.master_port) if serves else netcheck.master_problem(
            la.master_addr, first.master_port, la.join_timeout_s, log=say, listener=not cfg.dry_run)
        if problem:
            raise problem
    if cfg.dry_run:
        say("dry run: nothing launched.")
        return Outcome(str(run_dir.path), EXIT_OK, "dry-run")
    from .train.preflight import NODES_DIR, launcher_id

    here = run_dir.path / NODES_DIR / launcher_id()  # which nodes see it tells whether the run dir is shared
    if la.node_by_node:
        here.parent.mkdir(exist_ok=True)
        here.touch()
    try:
        code = supervise.supervise(first, run_dir, lambda c, r: _prepare(c, world, hw, prepared, run_dir, r), say)
    finally:
        here.unlink(missing_ok=True)
    shared = la.nnodes > 1 and la.shared_run_dir
    if cfg.trainer.report and run_dir.file("metrics.jsonl").is_file() and not (shared and la.node_rank != 0):
        _pictures(run_dir.path)  # one node draws into a shared run dir
    if code == EXIT_FAILED:
        say(f"training failed (exit code {code}); the failing rank's error is above. Run dir: {run_dir.path}")
    return Outcome(str(run_dir.path), code, {EXIT_OK: "completed", faults.EXIT_PREEMPTED: "preempted",
                                             faults.EXIT_OOM: "out of memory"}.get(code, "failed"))


def _prepare(cfg: RunConfig, world: World, hw: Hardware, prepared, run_dir: RunDir,
             resume: Optional[dict]) -> supervise.Launch:
    """Gate, plan, write the run dir's inputs and the command for one attempt (the first, or a relaunch
    after a fault with the repaired config)."""
    from .data import too_few_sequences

    cfg, decision = gated(cfg, world, hw, prepared, run_dir)
    if cfg.offload.device == OffloadDevice.nvme and not cfg.offload.nvme_path:
        # Resolved here so config.yaml and ds_config.json name the same directory.
        cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload, nvme_path=run_dir.default_nvme_path))
    plan = make_plan(cfg, world, prepared.longest)
    checkpoint.refuse_without_space(cfg, plan, decision.estimate.params, run_dir, resume)
    say(f"{cfg.model.name} ({'pretrained ' + cfg.model.name_or_path if cfg.model.pretrained else 'random init'}) · "
        f"ZeRO-{cfg.zero.stage} · offload {cfg.offload.device.value} · {cfg.precision.dtype.value} · "
        f"{world.size} rank(s)" + (f" = tensor-parallel {plan.tensor_parallel} × data-parallel "
                                   f"{plan.data_parallel_size}" if plan.tensor_parallel > 1 else "")
        + f" via {cfg.launcher.name.value}")
    replicas = f"{world.size} ranks" if plan.data_parallel_size == world.size else \
        f"{plan.data_parallel_size} data-parallel rank(s)"
    say(f"batch: micro {plan.micro_batch_size} × accum {plan.grad_accum_steps} × {replicas} = global "
        f"{plan.global_batch_size} sequences × {plan.seq_len} tokens = {plan.tokens_per_step} tokens per step, "
        f"{cfg.trainer.max_steps} steps")
    short = too_few_sequences(prepared.num_train, plan.global_batch_size,
                              f"{plan.data_parallel_size} data-parallel rank(s) × micro-batch {plan.micro_batch_size}"
                              f" × accumulation {plan.grad_accum_steps}")
    if short:
        raise short
    run_dir.write_inputs(config_yaml=OmegaConf.to_yaml(OmegaConf.structured(cfg)), plan=plan.to_json(),
                         ds_config=_ds_config(cfg, plan, resume, run_dir), prepared=prepared.to_json(), resume=resume,
                         estimate={**decision.estimate.to_json(), "gate": {
                             "mode": decision.mode.value, "ok": decision.ok, "message": decision.message,
                             "original_bound_bytes": decision.original.bound_bytes,
                             "changes": [dataclasses.asdict(c) for c in decision.changes]},
                             "predicted_step": speed.predict_step_time(cfg, plan).to_json()})
    if cfg.offload.device == OffloadDevice.nvme:
        Path(cfg.offload.nvme_path).mkdir(parents=True, exist_ok=True)
    ensure_ops(cfg, world.accelerator)  # after the gate: autofit may have moved the run to offload
    lp = _launch_plan(cfg, plan, run_dir, hw)
    if lp.launcher == "deepspeed" and lp.nnodes > 1 and not lp.hostfile:  # per node: shared run dirs differ
        Path(launcher.node_hostfile_path(lp.run_dir, lp.node_rank)).write_text(
            launcher.node_hostfile(lp.nnodes, lp.nproc_per_node))
    argv, env = launcher.build_command(lp)
    argv = quiet.launcher_argv(argv, cfg.verbose)
    line = launcher.shell_line(argv, env)
    run_dir.write_command(line)
    say(f"run dir: {run_dir.path}")
    say(f"command: {line}")
    if cfg.launcher.node_by_node:  # what each node's ranks compare (train/preflight.py);
        # not over pdsh: DeepSpeed forwards only some variables to the other nodes, and all must take part
        from .train import preflight

        env = {**env, preflight.ENV: json.dumps(preflight.launcher_facts(
            OmegaConf.to_yaml(OmegaConf.structured(cfg)), cfg.launcher.node_rank, [prepared.train, prepared.val],
            world.nproc_per_node, hw.gpus_per_node if world.accelerator == "cuda" else 0, str(run_dir.path.resolve()),
            cfg.launcher.shared_run_dir, (resume or {}).get("tag", "")))}
    return supervise.Launch(cfg=cfg, plan=plan, argv=argv, env=env, master_addr=lp.master_addr,
                            master_port=lp.master_port, estimate_bytes=decision.estimate.per_rank_peak_bytes,
                            resume=resume)


def _ds_config(cfg: RunConfig, plan: Plan, resume: Optional[dict], run_dir: RunDir) -> dict:
    from .ds_config import render

    ds = render(cfg, plan)
    if cfg.monitor != Monitor.none:  # DeepSpeed's own monitor, writing into the run dir
        section = {"tensorboard": "tensorboard", "csv": "csv_monitor", "wandb": "wandb"}[cfg.monitor.value]
        ds[section] = {"enabled": True, "project": cfg.name, "group": run_dir.path.name} if section == "wandb" else \
            {"enabled": True, "output_path": str(run_dir.path.resolve() / "monitor"), "job_name": "zerorun"}
    if resume and resume.get("universal"):  # a checkpoint converted for another data-parallel size
        ds["checkpoint"] = {**ds.get("checkpoint", {}), "load_universal": True}
    return ds


def _launch_plan(cfg: RunConfig, plan: Plan, run_dir: RunDir, hw: Hardware) -> launcher.LaunchPlan:
    la, world = cfg.launcher, plan.world
    return launcher.LaunchPlan(
        launcher=la.name.value, run_dir=str(run_dir.path.resolve()), nproc_per_node=world.nproc_per_node,
        accelerator=world.accelerator, nnodes=la.nnodes, node_rank=la.node_rank, master_addr=la.master_addr,
        master_port=la.master_port or launcher.free_port(), hostfile=la.hostfile,
        threads_per_rank=hw.threads_per_rank(world.nproc_per_node), mmap_threshold=mmap_threshold_bytes(la.mmap_threshold_mib),
        expandable_segments=la.expandable_segments, allocator=Allocator(la.allocator).value,
        allocator_library=allocators.library_for(Allocator(la.allocator)), mkl_fast_mm=la.mkl_fast_mm,
        bin_dir=launcher.default_bin_dir(),
        stop_timeout_s=la.stop_timeout_s, rdzv=la.rdzv.value, rdzv_id=la.rdzv_id or cfg.name,
        min_nnodes=la.min_nnodes or 0,
        rdzv_host=la.rdzv == Rendezvous.c10d and la.nnodes > 1 and netcheck.is_local(la.master_addr),
        local_addr=netcheck.route_addr(la.master_addr) if la.rdzv == Rendezvous.c10d and la.nnodes > 1 else "")


# ---------------------------------------------------------------------------------------------
# Hydra wiring

_state = {"task_started": False, "multirun": False, "outcomes": [], "why": ""}


@hydra.main(version_base=None, config_path="pkg://zerorun.conf", config_name="config")
def _hydra_app(raw: DictConfig) -> int:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    _state["task_started"] = True
    hc = HydraConfig.get()
    outcome = launch(raw, Path(hc.runtime.output_dir))
    _state["outcomes"].append(outcome)
    _state["multirun"] = hc.mode == RunMode.MULTIRUN
    if _state["multirun"]:  # hydra.job.num and the sweep dir exist only in a sweep
        outcome.point, outcome.overrides = hc.job.num, list(hc.overrides.task)
        _state["sweep_dir"] = hc.sweep.dir
        what = {"memory": "skipped, does not fit (memory gate)", "bad-config": "skipped, bad config",
                "bad-data": "skipped, bad data", "failed": f"failed (exit code {outcome.code})",
                "preempted": "stopped by a signal (resumable)", "out of memory": "out of memory after recoveries"}
        say(f"sweep point {hc.job.num} ({hc.job.override_dirname or 'defaults'}): "
            f"{what.get(outcome.status, outcome.status)}")
    return outcome.code


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``zerorun`` command; ``argv`` (without the program name) makes it callable in-process. On SageMaker
    and Slurm the platform's contract adds overrides first (zerorun.platforms)."""
    args = list(sys.argv[1:] if argv is None else argv)
    register_schemas()
    _state["why"] = ""
    failure = platforms.failure_file(os.environ)
    try:
        platform = platforms.detect(os.environ, args)
    except UserError as e:
        code = refuse(e)
        platforms.write_failure(failure, _state["why"])
        return code
    if platform:
        for note in platform.notes:
            say(note)
        for k, v in platform.env.items():
            os.environ.setdefault(k, v)
        # SageMaker: the user's words are in the platform's overrides already (hyperparameters and argv).
        args = platform.overrides if platform.name == "sagemaker" else platforms.merged(platform, args)
    code = _run(args)
    if code != EXIT_OK:
        platforms.write_failure(failure, _state["why"] or _recorded_reason() or f"zerorun exited {code} ("
                                + {faults.EXIT_PREEMPTED: "stopped by a signal; it resumes from its checkpoint",
                                   faults.EXIT_OOM: "out of memory after the recoveries zerorun could make"}.get(
                                       code, "training failed; the rank's error is in the job's log") + ")")
    if platform and platform.requeue and code == faults.EXIT_PREEMPTED and platform.node_rank == 0:
        import subprocess

        say("preempted: requeueing the job (" + " ".join(platform.requeue) + "); it resumes from the checkpoint")
        try:
            subprocess.run(platform.requeue, check=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            say(f"could not requeue: {e}; resubmit with the same run dir and trainer.resume=true")
    return code


def _pictures(path: Path) -> None:
    """zerorun-report's pictures; a plotting problem is a warning, never the run's failure."""
    from .report import report

    try:
        made = report(path)
        say("pictures: " + ", ".join(str(p) for p in made if p.suffix == ".png"))
    except Exception as e:  # noqa: BLE001
        say(f"warning: no pictures ({type(e).__name__}: {e}); zerorun-report {path} retries")


def _recorded_reason() -> str:
    """Why the last run stopped, as its supervisor recorded it (recoveries.json)."""
    outcomes = _state["outcomes"]
    events = RunDir(Path(outcomes[-1].run_dir)).read_recoveries() if outcomes else []
    return f"zerorun exited {outcomes[-1].code}: {events[-1]['reason']}" if events and events[-1].get("reason") else ""


def _run(args: List[str]) -> int:
    flags = {a.split("=")[0] for a in args if a.startswith("-")}
    try:
        hydra_words_problem(args)
    except UserError as e:
        return refuse(e)
    if not flags:
        # A single run: compose it once here, so a composition error (unknown option, wrong type, typo) is
        # one line and exit 2 instead of Hydra's multi-line report and exit 1.
        try:
            compose([a for a in args if not a.startswith(("hydra.", "hydra/", "+hydra"))])
        except UserError as e:
            return refuse(e)
    else:
        typos = unknown_override_keys(args) + unknown_group_choices(args)
        if typos:
            return refuse(ConfigError(typos))
    _state.update(task_started=False, multirun=False, outcomes=[])
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "zerorun", *args]
    try:
        _hydra_app()
    except SystemExit as e:
        # Hydra exits 1 on its own composition errors (unknown group option, key typo): ours is 2.
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_FAILED)
        if code == 1 and not _state["task_started"]:
            return EXIT_BAD_INPUT
        if code != 0:
            return code
    finally:
        sys.argv = saved_argv
    outcomes: List[Outcome] = _state["outcomes"]
    if len(outcomes) == 1 and not _state["multirun"]:
        return outcomes[0].code
    if outcomes:
        failed = [o for o in outcomes if o.status in ("failed", "preempted", "out of memory")]
        say(f"sweep: {len(outcomes)} points: " + ", ".join(
            f"{s} {sum(o.status == s for o in outcomes)}" for s in sorted({o.status for o in outcomes})))
        from . import sweep

        points = [sweep.point_of(o.point, o.overrides, o.status, (o.notes or [""])[0][:300], o.run_dir)
                  for o in outcomes]
        best = sweep.write(Path(_state["sweep_dir"]), points)
        _pictures(Path(_state["sweep_dir"]))
        if best:
            say(f"sweep: the fastest point is {best.point} ({' '.join(best.overrides) or 'defaults'}); "
                f"summary in {Path(_state['sweep_dir']) / 'sweep_summary.md'} and .csv")
        if failed:
            return max(o.code for o in failed) or EXIT_FAILED
        if all(o.code == EXIT_BAD_INPUT for o in outcomes):
            return EXIT_BAD_INPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

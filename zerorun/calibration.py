"""Calibrate the memory gate on this machine: measure what it predicts, once, and keep the difference.

``zerorun-calibrate <overrides>`` (or ``gate=calibrate``) runs the composed config for a few steps on this
node, as the launch would (its ranks per node, one process each, the real rank code), reads the figure
that runs out on every rank (a CPU rank's peak RSS; a GPU rank's reserved peak + what lives outside the
allocator) and stores the worst rank's measured − estimated under the config's correction key
(memory.correction_key: the architecture, batch shape, precision, ZeRO stage and offload, the ranks and
layout on a node, the device model and the software versions) in ``<cache>/calibration.json``. Later
estimates with the same key add it as a named component and say "calibrated on this machine".
Why not one process: a one-rank probe of GPT-2 small (bf16, ZeRO-2) measured +145 MiB over its estimate
where the same config on 2 ranks is +35 MiB: the residual depends on the ranks. docs/memory.md §5.5.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Optional

from . import allocators, process_probe
from .config import RunConfig, make_plan, plan_world
from .config.rules import mmap_threshold_bytes
from .hardware import Hardware
from .memory import DEFAULT_CALIBRATION, Calibration, correction_key, estimate
from .memory.priors import RUNTIME_OVERHEAD
from .rundir import RunDir, write_atomic

CACHE_NAME = "calibration.json"
BASELINE = "process-baseline"  # calibration.json keys of measured process baselines (not corrections)
PROBE_STEPS = 3
RANK_RUNTIME = 7
"""Bumped when zerorun's own rank code changes what a rank holds, or what the estimate counts of a micro rank
(its runtime overhead is the rest), which package versions do not show in an editable install: measurements made
before are not reused (2: CPU ranks skip DeepSpeed's shm comm op; 3: GPT-2's gelu_new runs fused: its GeLU saves
one MLP-wide tensor, not four; 4: a preloaded allocator's page heap from its blocks, memory/page_heap.py; 5: a
rank's peak is its own VmHWM, where getrusage gave a probe the gate's peak: 16 of 415 stored overheads 4-48 MiB
high; 6: tcmalloc's caches are the micro rank's measured figure, not the overhead's; 7: a traced model's micro rank
is micro, its config.json fields shrunk, not two layers of the real widths; ZeRO-3 counts its step's fp64 norm)."""


@functools.lru_cache(maxsize=1)  # what is installed does not change within a process (~0.1 s to read)
def environment() -> str:
    """The software a correction is valid for (read from package metadata: nothing heavy is imported): the main
    packages' versions, and which Python environment with which installed distributions. Two venvs with the same
    torch/DeepSpeed/transformers hold different amounts resident in a rank (measured: 463 MiB at "ready" in the test
    venv, 527 MiB in a user's install without the test extras), and ~/.cache/zerorun is shared between them."""
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"
    installed = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions())
    venv = hashlib.sha256("\n".join([sys.prefix, *installed]).encode()).hexdigest()[:12]
    return (",".join(f"{n}={version(n)}" for n in ("torch", "deepspeed", "transformers", "zerorun"))
            + f",rank={RANK_RUNTIME},env={venv}")


def boot_id() -> str:
    """This boot of this machine. A process baseline is kept for one boot only: what a rank's imports hold resident
    moved by 67 MiB between boots of one machine with the same software (ranks at 428 MiB "ready" gated with a
    495 MiB baseline stored earlier: every tiny model 9-14% over), so it is measured again after a reboot (6 s)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "-"


def measured_this_boot(record: Optional[Dict[str, Any]], env: str) -> bool:
    """A stored process baseline or runtime overhead applies: the same software, measured since this machine last
    booted."""
    return bool(record) and record.get("environment") == env and record.get("boot") == boot_id()


def cache_file(cfg: RunConfig) -> Path:
    from .data import cache_root

    return cache_root(cfg.data) / CACHE_NAME


def load(path: Path) -> Dict[str, Dict[str, Any]]:
    """The stored records; a damaged file (not JSON, or records of the wrong shape) reads as empty, so what it
    held is measured again and the file rewritten whole (write_atomic), never trusted."""
    try:
        records = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        records = None
    numbers = ("correction_bytes", "baseline_bytes", "measured_bytes", "estimated_bytes")
    if not isinstance(records, dict) or not all(
            isinstance(r, dict) and all(isinstance(r.get(k, 0), (int, float)) for k in numbers)
            for r in records.values()):
        print(f"zerorun: the calibration cache {path} is damaged: measuring again", file=sys.stderr)
        return {}
    return records


def calibration_for(cfg: RunConfig, hw: Optional[Hardware] = None) -> Calibration:
    """The gate's terms with what was measured on this machine for this software: every stored correction,
    and on CPU ranks (``hw`` given) the process baseline (pure otherwise)."""
    env = environment()
    records = load(cache_file(cfg))
    corrections = tuple((k, int(r["correction_bytes"])) for k, r in sorted(records.items())
                        if r.get("environment") == env and "correction_bytes" in r)
    cal = dataclasses.replace(DEFAULT_CALIBRATION, environment=env, corrections=corrections)
    if hw is None or hw.accelerator != "cpu":
        return cal
    baseline = records.get(baseline_key(cfg, hw))
    if measured_this_boot(baseline, env):
        cal = dataclasses.replace(cal, cpu_process_bytes=int(baseline["baseline_bytes"]), process_measured=True)
    probes = [(k, r) for k, r in sorted(records.items())
              if k.startswith(RUNTIME_OVERHEAD) and measured_this_boot(r, env)]
    overheads = tuple((k, int(r["overhead_bytes"])) for k, r in probes if r.get("overhead_bytes") is not None)
    caches = tuple((k, int(r["allocator_cache_bytes"])) for k, r in probes if r.get("allocator_cache_bytes"))
    return dataclasses.replace(cal, runtime_overheads=overheads, allocator_caches=caches)


def baseline_key(cfg: RunConfig, hw: Hardware) -> str:
    from .arch import model_code

    return f"{BASELINE}|{hw.device_name or hw.accelerator}|{model_code(cfg.model)}|{allocators.concrete(cfg.launcher).value}"


def ensure_baseline(cfg: RunConfig, hw: Hardware, log=print) -> None:
    """CPU ranks: measure what a rank's process holds beyond its tensors on this machine, once per boot,
    software and kind of run (process_probe: a micro rank of the same kind, ~10 s), and store the process
    baseline and the runtime overhead beside the corrections. Where the micro rank fails, the baseline alone
    (python -m zerorun.train.baseline, ~6 s); where that fails too, the priors. It never stops a launch."""
    import tempfile

    from .arch import model_code

    path = cache_file(cfg)
    env = environment()
    if hw.accelerator != "cpu":
        return
    key, okey = baseline_key(cfg, hw), process_probe.overhead_key(cfg, hw)
    stored = load(path)
    if measured_this_boot(stored.get(key), env) and measured_this_boot(stored.get(okey), env):
        return
    log("measuring what a CPU rank holds beyond its tensors on this machine: a micro model of this kind of run "
        "(once per boot, software and kind) ...")
    t0 = time.perf_counter()
    new: Dict[str, Dict[str, Any]] = {}
    stamp = {"environment": env, "boot": boot_id(), "device": hw.device_name, "model": model_code(cfg.model),
             "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        with tempfile.TemporaryDirectory(prefix="zerorun-probe-") as tmp:
            got = process_probe.measure(cfg, hw, Path(tmp), DEFAULT_CALIBRATION)
        new[okey] = {**got, **stamp, "measure": "a micro rank's VmHWM less what the estimator counts for it"}
        measured = got["ready_bytes"]
    except (subprocess.SubprocessError, OSError, RuntimeError, ValueError, KeyError) as e:
        log(f"warning: the micro rank failed ({str(e).strip()[-300:] or type(e).__name__}); measuring the "
            "process baseline alone, the runtime overhead stays the prior")
        measured = _baseline_alone(cfg, log)
        if measured is None:
            return
    new[key] = {"baseline_bytes": measured, **stamp, "measure": "VmHWM of a rank at ready",
                "seconds": round(time.perf_counter() - t0, 1)}
    path.parent.mkdir(parents=True, exist_ok=True)
    records = load(path)
    records.update(new)
    write_atomic(path, json.dumps(records, indent=2) + "\n")
    overhead, said = new.get(okey, {}).get("overhead_bytes"), ""
    if overhead is not None:
        said = f", runtime overhead {overhead / 2**20:.0f} MiB"
    elif okey in new:  # the micro rank ran but held less than the estimator counts for it
        said = (", runtime overhead not measurable for this kind (the estimator counts more than the micro rank "
                "held): the prior")
    log(f"process baseline {measured / 2**20:.0f} MiB per CPU rank (prior "
        f"{DEFAULT_CALIBRATION.cpu_process_bytes / 2**20:.0f} MiB){said}"
        f", in {time.perf_counter() - t0:.0f} s; stored in {path}.")


def _baseline_alone(cfg: RunConfig, log) -> Optional[int]:
    """A rank's process at "ready" without training anything (python -m zerorun.train.baseline)."""
    from . import launcher
    from .arch import model_code

    proc = None
    try:
        proc = subprocess.run([sys.executable, "-m", "zerorun.train.baseline", model_code(cfg.model)],
                              env={**os.environ, **launcher.rank_env("cpu", 1, **allocators.rank_env_args(cfg.launcher))},
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=600, start_new_session=True)
        return int(json.loads(proc.stdout.strip().splitlines()[-1])["baseline_bytes"])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError, KeyError) as e:
        tail = proc.stderr[-500:] if proc is not None else ""
        log(f"warning: could not measure the process baseline ({e or type(e).__name__}); the gate uses its "
            f"prior {DEFAULT_CALIBRATION.cpu_process_bytes / 2**20:.0f} MiB. {tail or ''}".strip())
        return None


def probe_config(cfg: RunConfig, hw: Hardware) -> RunConfig:
    """The config as this node's ranks run it for a few steps: one node, nothing saved or exported, no
    accumulation (a pipeline keeps one micro-batch per stage)."""
    nproc = plan_world(cfg, hw, nodes=1).nproc_per_node
    tr = dataclasses.replace(cfg.trainer, max_steps=PROBE_STEPS, save_every=0, eval_every=0, export=False,
                             progress=False, resume=False, resume_from="", global_batch_size=None, warmup_steps=1)
    la = dataclasses.replace(cfg.launcher, nproc_per_node=nproc, nnodes=1, node_rank=0, master_addr="127.0.0.1",
                             hostfile="", master_port=None)
    par = cfg.parallel
    if par.mode.value == "pipeline":
        par = dataclasses.replace(par, micro_batches=max(par.stages, 1))
    return dataclasses.replace(cfg, trainer=tr, launcher=la, parallel=par, dry_run=False)


def probe(cfg: RunConfig, hw: Hardware, prepared, work: Path, log=print) -> Dict[str, Any]:
    """Run the probe and store its correction; returns the record."""
    from omegaconf import OmegaConf

    from . import launcher
    from .ds_config import render
    from .train.memory_report import compare_with_estimate

    pcfg = probe_config(cfg, hw)
    world = plan_world(pcfg, hw, nodes=1)
    plan = make_plan(pcfg, world, prepared.longest)
    ensure_baseline(cfg, hw, log=log)  # the correction is measured over the machine's own baseline
    prior = dataclasses.replace(calibration_for(cfg, hw), corrections=())
    est = estimate(pcfg, plan, hw, cal=prior)
    key = correction_key(pcfg, plan, hw, prior.environment)
    rd = RunDir(work)
    rd.write_inputs(config_yaml=OmegaConf.to_yaml(OmegaConf.structured(pcfg)), plan=plan.to_json(),
                    ds_config=render(pcfg, plan), estimate=est.to_json(), prepared=prepared.to_json(), resume=None)
    lp = launcher.LaunchPlan(launcher="torchrun", run_dir=str(work), nproc_per_node=world.nproc_per_node,
                             accelerator=hw.accelerator, master_port=launcher.free_port(),
                             threads_per_rank=hw.threads_per_rank(world.nproc_per_node),
                             mmap_threshold=mmap_threshold_bytes(pcfg.launcher.mmap_threshold_mib),
                             **allocators.rank_env_args(pcfg.launcher), bin_dir=launcher.default_bin_dir())
    argv, env = launcher.build_command(lp)
    log(f"calibrating on this machine ({hw.device_name or hw.accelerator}): {PROBE_STEPS} steps of "
        f"{cfg.model.name} on {world.nproc_per_node} rank(s) ...")
    t0 = time.perf_counter()
    with open(work / "probe.log", "w") as out:
        rc = subprocess.run(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True).returncode
    summary = rd.read_summary()
    if rc != 0 or summary is None:
        kept = cache_file(cfg).with_name("calibration-failed.log")
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text((work / "probe.log").read_text())
        raise RuntimeError(f"the calibration probe failed (exit {rc}); its whole log is in {kept}, ending:\n"
                           + kept.read_text()[-2000:])
    rows = compare_with_estimate(rd.read_estimate(), summary["peak_memory"])
    row = max(rows, key=lambda r: r["measured_bytes"] - r["estimated_bytes"])  # the gate must cover every rank
    record = {"correction_bytes": int(row["measured_bytes"] - row["estimated_bytes"]),
              "measured_bytes": int(row["measured_bytes"]), "estimated_bytes": int(row["estimated_bytes"]),
              "measure": row["measure"], "environment": prior.environment, "device": hw.device_name,
              "model": cfg.model.name, "seconds": round(time.perf_counter() - t0, 1),
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = cache_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = load(path)
    records[key] = record
    write_atomic(path, json.dumps(records, indent=2) + "\n")
    return {"key": key, **record}


def has_correction(cfg: RunConfig, hw: Hardware, cal: Calibration) -> Optional[int]:
    """The stored correction for ``cfg`` on this machine, if any."""
    pcfg = probe_config(cfg, hw)
    plan = make_plan(pcfg, plan_world(pcfg, hw, nodes=1))
    return cal.correction(correction_key(pcfg, plan, hw, cal.environment))


USAGE = """usage: zerorun-calibrate [--list] <overrides as for zerorun>

Runs the composed config for a few steps as one rank of this machine and stores the difference between
the memory it used and the gate's estimate; later zerorun gates and sweeps with the same model, batch
shape, precision, ZeRO stage and offload on this machine use it ("calibrated on this machine").
--list shows what is stored. Exit codes: 0 done; 2 bad config; 1 the probe failed."""


def main(argv=None) -> int:
    import tempfile

    from .config import ConfigError, UserError, check, compose, plan_world
    from .data import prepare
    from .hardware import GIB, detect

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    listing = "--list" in args
    args = [a for a in args if a != "--list"]
    try:
        cfg = compose(args)
        if listing:
            for key, r in load(cache_file(cfg)).items():
                if "baseline_bytes" in r:
                    print(f"{key}  process baseline {r['baseline_bytes'] / 2**20:.0f} MiB  ({r['device']}, {r['when']})")
                    continue
                print(f"{key}  {r['model']:12s} {r['measure']}: measured {r['measured_bytes'] / GIB:.2f} GiB, "
                      f"estimated {r['estimated_bytes'] / GIB:.2f}, correction {r['correction_bytes'] / 2**20:+.0f} MiB"
                      f"  ({r['device']}, {r['when']})")
            return 0
        hw = detect()
        cfg, _ = allocators.with_allocator(cfg, hw.accelerator)  # the allocator zerorun's ranks would run here
        problems = check(probe_config(cfg, hw), plan_world(probe_config(cfg, hw), hw))
        if problems:
            raise ConfigError(problems)
        prepared = prepare(cfg.data, cfg.model, cfg.seed, make_plan(cfg, plan_world(cfg, hw)).task.value,
                           cfg.task.num_labels)
    except UserError as e:
        for p in (e.problems if isinstance(e, ConfigError) else [e]):
            print(f"zerorun-calibrate: error: {p}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="zerorun-calibrate-") as work:
        try:
            r = probe(cfg, hw, prepared, Path(work), log=lambda m: print(f"zerorun-calibrate: {m}", file=sys.stderr))
        except RuntimeError as e:
            print(f"zerorun-calibrate: {e}", file=sys.stderr)
            return 1
    print(f"{cfg.model.name} on {hw.device_name or hw.accelerator}: {r['measure']} measured "
          f"{r['measured_bytes'] / GIB:.3f} GiB, estimated {r['estimated_bytes'] / GIB:.3f} GiB "
          f"({100 * (r['estimated_bytes'] - r['measured_bytes']) / r['measured_bytes']:+.1f}%); correction "
          f"{r['correction_bytes'] / 2**20:+.0f} MiB stored in {cache_file(cfg)} ({r['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

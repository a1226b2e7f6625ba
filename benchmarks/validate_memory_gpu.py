"""GPU validation of zerorun.memory: real DeepSpeed training steps on CUDA against the estimate.

    python benchmarks/validate_memory_gpu.py                 # 1 GPU, the whole matrix
    python benchmarks/validate_memory_gpu.py --nproc 2       # 2 GPUs through torchrun (ZeRO partitions over 2)
    python benchmarks/validate_memory_gpu.py --dry-run       # no GPU needed: the matrix and its estimates
    python benchmarks/validate_memory_gpu.py --models tiny-gpt2 --zero 2 --dtypes bf16 --json out.json

The matrix is the CPU test's (tests/unit/test_memory_validation.py): tiny-gpt2, tiny-bert, gpt2 and
bert-base-uncased × ZeRO 0–3 × offload none/cpu (cpu with ZeRO ≥ 1) × fp32/bf16 × activation
checkpointing off/on × two sequence lengths per model. One worker process per model × ZeRO × offload ×
dtype (CUDA state starts clean), built as zerorun.train builds it (the ds_config zerorun renders, FusedAdam,
DeepSpeedCPUAdam with offload). For each checkpointing × seq point: ``--warmup`` steps, then
``torch.cuda.reset_peak_memory_stats()`` and ``--steps`` measured steps, each read in two parts
(forward+backward, optimizer step); ``torch.cuda.empty_cache()`` between points so ``memory_reserved``
belongs to the point. The init peak (model build + deepspeed.initialize) is read before the first reset.

Per point it prints, in the CPU test's table format (each cell estimate, measured, % error):
model states (read from the engine's tensors), forward+backward peak and optimizer-step peak
(``max_memory_allocated``), TOTAL = max(init, fwd+bwd, step) against the estimate's allocator peak; then
``memory_reserved`` against (1 + allocator margin) × allocator peak, and the device memory in use
(``mem_get_info``: context + NCCL + reserved) against the estimate's per-GPU peak. The accuracy lines at
the end use the issue's targets (median |error| ≤ 5%, worst ≤ 10%, never more than 5% under). With
more than one rank every number is rank 0's (ranks are symmetric under ZeRO-DP), except the maxima taken
over ranks with an all-reduce.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from zerorun import memory as M  # noqa: E402
import memory_harness as MM  # noqa: E402
from zerorun.config import Dtype, OffloadDevice, World, default_task, make_plan  # noqa: E402
from zerorun.hardware import GIB, Hardware  # noqa: E402
from zerorun.launcher import rank_env  # noqa: E402

DEFAULT_MODELS = ("tiny-gpt2", "tiny-bert", "gpt2", "bert-base-uncased")
DEFAULT_SEQS = {"tiny-gpt2": (64, 256), "tiny-bert": (64, 256), "gpt2": (128, 512), "bert-base-uncased": (128, 512)}


# ---------------------------------------------------------------------------------------------- matrix


def matrix(args) -> List[Dict[str, Any]]:
    """One job per model × ZeRO × offload × dtype; each lists its (checkpointing, seq) points."""
    jobs = []
    for name in args.models:
        m = MM.model_file(name)
        seqs = [s for s in (args.seqs or DEFAULT_SEQS.get(name, (128, 512))) if s <= m.max_positions]
        for dtype in args.dtypes:
            for lay in MM.engine_matrix():
                stage, off = lay.stage, lay.device
                if stage not in args.zero or off.value not in args.offload:
                    continue
                jobs.append({"model": name, "dtype": dtype, "zero": stage, "offload": off.value,
                             "offload_params": lay.params, "micro": args.micro,
                             "subs": [[ckpt, s] for ckpt in (False, True) for s in seqs],
                             "warmup": args.warmup, "steps": args.steps})
    return jobs


def world_of(nproc: int) -> World:
    return World(nproc_per_node=nproc, nnodes=1, accelerator="cuda")


def estimate_point(job: Dict[str, Any], ckpt: bool, seq: int, world: World, hw: Hardware) -> Dict[str, Any]:
    """The estimate for one point (CUDA ranks): the allocator-side numbers as on CPU, plus reserved and device."""
    m = MM.model_file(job["model"])
    cfg = MM.run_cfg(m, Dtype(job["dtype"]), ckpt, seq, job["micro"], job["zero"], OffloadDevice(job["offload"]),
                     job.get("offload_params"))
    est = M.estimate(cfg, make_plan(cfg, world), hw)
    ph = {k: sum(v.values()) for k, v in est.phases.items()}
    alloc = max(ph.values())
    return {"fwd_bwd": max(ph[k] for k in MM.FWD_BWD_PHASES if k in ph), "step": ph["optimizer step"],
            "total": alloc, "phase": est.peak_phase,
            "states": sum(v for k, v in est.phases["optimizer step"].items() if k in MM.STATE_KEYS),  # device only
            "reserved": alloc + est.components.get("allocator margin", 0),  # the margin the ranks' allocator gets
            "device": est.per_rank_peak_bytes, "bound": est.bound_bytes, "fits": est.fits,
            "host": est.host_bytes_per_node // world.nproc_per_node}


# ---------------------------------------------------------------------------------------------- worker (one rank)


def worker(job: Dict[str, Any], out: str) -> None:
    """Runs under torchrun (or alone as rank 0 of 1): one engine, every point of ``job``."""
    MM.setup_process(threads=int(os.environ.get("OMP_NUM_THREADS", "4")))
    os.environ["DS_ACCELERATOR"] = "cuda"
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from zerorun.ds_config import render
    from zerorun.models import build_model
    from zerorun.ops import set_build_flags
    from zerorun.telemetry import peak_rss_bytes

    set_build_flags()  # FusedAdam/CPUAdam with the flags zerorun's prebuild and ranks use: no rebuild per process

    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    rank, nproc = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", 0))
    get_accelerator().set_device(local)
    dev = torch.device("cuda", local)
    m = MM.model_file(job["model"])
    cfg = MM.run_cfg(m, Dtype(job["dtype"]), False, job["subs"][0][1], job["micro"], job["zero"],
                     OffloadDevice(job["offload"]), job.get("offload_params"))
    ds = render(cfg, make_plan(cfg, world_of(nproc)))

    def gmax(x: int) -> int:
        t = torch.tensor([x], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    rows: List[Dict[str, Any]] = []
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        torch.manual_seed(0)
        model = build_model(m, default_task(m.family), 2)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
        del model
        init_peak = gmax(torch.cuda.max_memory_allocated(dev))
        for ckpt, seq in job["subs"]:
            if ckpt:
                engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                engine.module.gradient_checkpointing_disable()
            inputs = MM.batch(m, job["micro"], seq, device=str(dev))
            row: Dict[str, Any] = {"kind": "engine", "model": m.name, "dtype": job["dtype"], "zero": job["zero"],
                                   "offload": job["offload"], "offload_params": job.get("offload_params"), "ckpt": ckpt, "seq": seq,
                                   "micro": job["micro"],
                                   "nproc": nproc, "init": init_peak}
            try:
                torch.cuda.empty_cache()
                for _ in range(job["warmup"]):
                    engine.backward(engine(**inputs).loss)
                    engine.step()
                torch.cuda.synchronize(dev)
                fb = step = reserved = 0
                for _ in range(job["steps"]):
                    torch.cuda.reset_peak_memory_stats(dev)
                    loss = engine(**inputs).loss
                    engine.backward(loss)
                    del loss
                    torch.cuda.synchronize(dev)
                    fb = max(fb, torch.cuda.max_memory_allocated(dev))
                    reserved = max(reserved, torch.cuda.max_memory_reserved(dev))
                    torch.cuda.reset_peak_memory_stats(dev)
                    engine.step()
                    torch.cuda.synchronize(dev)
                    step = max(step, torch.cuda.max_memory_allocated(dev))
                    reserved = max(reserved, torch.cuda.max_memory_reserved(dev))
                free, total = torch.cuda.mem_get_info(dev)
                row.update(fwd_bwd=gmax(fb), step=gmax(step), reserved=gmax(reserved), device=gmax(total - free),
                           host=gmax(peak_rss_bytes()))  # the rank's host VmHWM so far (the host gate's figure)
                row["total"] = max(init_peak, row["fwd_bwd"], row["step"])
                row["states"] = MM.engine_model_states(engine, "cuda")
            except torch.cuda.OutOfMemoryError as e:
                row["oom"] = str(e).splitlines()[0]
            rows.append(row)
    except torch.cuda.OutOfMemoryError as e:
        rows.append({"model": m.name, "dtype": job["dtype"], "zero": job["zero"], "offload": job["offload"],
                     "oom": "init: " + str(e).splitlines()[0]})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def launch(job: Dict[str, Any], nproc: int, timeout: int) -> List[Dict[str, Any]]:
    """Run one job's worker(s) in fresh processes; return rank 0's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "job.json", Path(tmp) / "rows.json"
        spec.write_text(json.dumps(job))
        port = str(MM.free_port())
        env = dict(os.environ, DS_ACCELERATOR="cuda", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.setdefault("TORCH_EXTENSIONS_DIR", MM.extensions_dir())
        env.update({k: v for k, v in rank_env("cuda", 1).items() if k == "PYTORCH_CUDA_ALLOC_CONF"})  # as zerorun's ranks
        args = [str(Path(__file__).resolve()), "--worker", str(spec), "--worker-out", str(out)]
        if nproc == 1:
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
            cmd = [sys.executable, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   "--master_addr=127.0.0.1", f"--master_port={port}", *args]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
            return [{"model": job["model"], "dtype": job["dtype"], "zero": job["zero"], "offload": job["offload"],
                     "error": f"worker exited {proc.returncode}:\n{tail}"}]
        return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------- report


def extra_table(pairs: List[Tuple[Dict[str, Any], Dict[str, Any]]]) -> List[str]:
    hdr = (f"{'model':17s} {'dtype':5s} {'zero':>4s} {'offload':7s} {'ckpt':4s} {'seq':>4s} | "
           f"{'reserved est':>12s} {'meas':>8s} {'err':>7s} | {'device est':>10s} {'meas':>8s} {'err':>7s}")
    lines = [hdr + "   (MiB; device = context + NCCL + reserved, per GPU)", "-" * len(hdr)]
    for r, e in pairs:
        lines.append(f"{r['model']:17s} {r['dtype']:5s} {r['zero']:4d} {r['offload']:7s} "
                     f"{'on' if r['ckpt'] else 'off':4s} {r['seq']:4d} | {MM.cell(e['reserved'], r['reserved'], 12)} | "
                     f"{MM.cell(e['device'], r['device'], 10)}")
    return lines


def dry_run(jobs, world: World, hw: Hardware) -> None:
    print(f"dry run: {len(jobs)} engine jobs, {sum(len(j['subs']) for j in jobs)} points on {world.size} rank(s) "
          f"of {hw.describe()}; estimates only (no GPU needed)")
    hdr = (f"{'model':17s} {'dtype':5s} {'zero':>4s} {'offload':7s} {'ckpt':4s} {'seq':>4s} | {'states':>8s} "
           f"{'fwd+bwd':>8s} {'step':>8s} {'TOTAL':>8s} {'reserved':>9s} {'device':>8s}  peak phase   (MiB)")
    print(hdr)
    print("-" * len(hdr))
    for job in jobs:
        for ckpt, seq in job["subs"]:
            e = estimate_point(job, ckpt, seq, world, hw)
            print(f"{job['model']:17s} {job['dtype']:5s} {job['zero']:4d} {job['offload']:7s} "
                  f"{'on' if ckpt else 'off':4s} {seq:4d} | " + " ".join(
                      f"{e[k] / MM.MIB:{w}.1f}" for k, w in (("states", 8), ("fwd_bwd", 8), ("step", 8),
                                                            ("total", 8), ("reserved", 9), ("device", 8)))
                  + f"  {e['phase']}{'' if e['fits'] else '  (does not fit)'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) per job; >1 runs torchrun")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--zero", default="0,1,2,3")
    ap.add_argument("--offload", default="none,cpu")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--seqs", default="", help="sequence lengths for every model (default: per model, "
                    + ", ".join(f"{k} {v}" for k, v in DEFAULT_SEQS.items()) + ")")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per job")
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0, help="--dry-run: the GPU to plan for")
    ap.add_argument("--json", default="", help="also write the measured and estimated rows here")
    ap.add_argument("--dry-run", action="store_true", help="print the matrix and its estimates; no GPU needed")
    ap.add_argument("--rescore", nargs="+", default=[], metavar="JSON",
                    help="no GPU needed: the rows measured in these --json files against today's estimator")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()), args.worker_out)
        return
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    args.models, args.dtypes, args.offload = split(args.models), split(args.dtypes), split(args.offload)
    args.zero = [int(z) for z in split(args.zero)]
    args.seqs = [int(s) for s in split(args.seqs)]
    if args.rescore:
        report(rescore(args.rescore, args.gpu_mem_gib))
        return
    jobs = matrix(args)
    world = world_of(args.nproc)
    if args.dry_run:
        hw = Hardware("cuda", args.nproc, int(args.gpu_mem_gib * GIB), 256 * GIB, 1, 16)
        dry_run(jobs, world, hw)
        return
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    if gpus == 0:
        sys.exit("validate_memory_gpu: no CUDA device here (torch.cuda.is_available() is False). This script "
                 "measures real GPU memory; run it on a machine with a GPU and the CUDA build of torch, or use "
                 "--dry-run to print the matrix and its estimates. On CPU, tests/unit/test_memory_validation.py "
                 "checks what CPU can show.")
    if gpus < args.nproc:
        sys.exit(f"validate_memory_gpu: --nproc {args.nproc} needs {args.nproc} GPUs; this machine has {gpus}.")
    props = torch.cuda.get_device_properties(0)
    from zerorun.hardware import host_memory_bytes

    hw = Hardware("cuda", args.nproc, props.total_memory, host_memory_bytes(), 1, os.cpu_count() or 1)
    print(f"{props.name}, {props.total_memory / GIB:.1f} GiB × {args.nproc} rank(s); {len(jobs)} jobs, "
          f"{sum(len(j['subs']) for j in jobs)} points; warm-up {args.warmup}, measured {args.steps} steps",
          flush=True)
    t0 = time.perf_counter()
    pairs, problems = [], []
    for job in jobs:
        t = time.perf_counter()
        for r in launch(job, args.nproc, args.timeout):
            if "error" in r or "oom" in r:
                problems.append(f"{r['model']} {r['dtype']} ZeRO-{r['zero']} offload {r['offload']}"
                                f"{' ckpt ' + str(r.get('ckpt')) + ' seq ' + str(r.get('seq')) if 'seq' in r else ''}: "
                                f"{r.get('error') or 'OOM ' + r['oom']}")
                continue
            pairs.append((r, estimate_point(job, r["ckpt"], r["seq"], world, hw)))
        print(f"  {job['model']} {job['dtype']} ZeRO-{job['zero']} offload {job['offload']}: "
              f"{time.perf_counter() - t:.0f} s", flush=True)
        if args.json:  # after every job: a run cut short by its time limit keeps what it measured
            Path(args.json).write_text(json.dumps([{"measured": r, "estimate": e} for r, e in pairs], indent=1))
    report(pairs)
    for p in problems:
        print(f"  not measured: {p}")
    print(f"done in {time.perf_counter() - t0:.0f} s")


def rescore(paths: List[str], gpu_mem_gib: float) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """Measured rows of earlier runs (their --json), each against today's estimate of its point."""
    pairs = []
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            r = row["measured"]
            job = {"model": r["model"], "dtype": r["dtype"], "zero": r["zero"], "offload": r["offload"],
                   "offload_params": r.get("offload_params"), "micro": r["micro"]}
            hw = Hardware("cuda", r["nproc"], int(gpu_mem_gib * GIB), 256 * GIB, 1, 16)
            pairs.append((r, estimate_point(job, r["ckpt"], r["seq"], world_of(r["nproc"]), hw)))
    return pairs


def report(pairs: List[Tuple[Dict[str, Any], Dict[str, Any]]]) -> None:
    print()
    for line in MM.engine_table(pairs):
        print(line)
    print()
    for line in extra_table(pairs):
        print(line)
    print()
    err = MM._err
    for name, key in (("TOTAL (allocator peak)", "total"), ("fwd+bwd peak", "fwd_bwd"), ("optimizer-step peak", "step"),
                      ("reserved", "reserved"), ("device in use", "device"), ("host peak RSS (VmHWM)", "host")):
        errors = [err(e[key], r[key]) for r, e in pairs if key in r and key in e]
        if errors:
            print("  " + MM.Accuracy(name, errors).line())
    under = [(r, e) for r, e in pairs if "bound" in e and e["bound"] < r["device"]]
    print(f"  the bound (what the gate decides on) above the measured device memory at {len(pairs) - len(under)} of "
          f"{len(pairs)} points" + "".join(f"; under at {r['model']} ZeRO-{r['zero']} {r['offload']} seq {r['seq']}"
                                           for r, _ in under))


if __name__ == "__main__":
    main()

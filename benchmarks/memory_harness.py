"""Measure on CPU what zerorun.memory estimates, and compare the two (docs/memory.md §8).

One place for the measurement helpers that tests/integration/test_memory_validation.py,
benchmarks/validate_memory_cpu.py and benchmarks/validate_memory_gpu.py share. Not part of the
package (a launch never uses it); what a rank itself measures lives in zerorun.telemetry, which this
uses. torch, transformers and deepspeed are imported inside the functions that need them, so the
pure parts (configs, estimates, the table, the error summary) import nothing heavy.

Two kinds of measurement, both with real tensors in one process, one thread:

- ``measure_activations``: a plain HF model (no DeepSpeed) in the module dtype. The bytes autograd saves
  in forward (``saved_tensors_hooks``, unique storages, parameters excluded), the LM loss's saved
  log_softmax output, and the forward/backward peak of the second of two accumulating micro-steps
  (parameters and buffers excluded), as benchmarks/validate_memory_cpu.py always did.
- ``measure_engine``: a real DeepSpeed engine on one rank (gloo, DS_ACCELERATOR=cpu, the ds_config
  zerorun renders; torch AdamW, or DeepSpeedCPUAdam with offload). A byte tracker (``live_bytes``, the
  live-storage accounting of torch's MemTracker) is active from before the model is built, so it sees every tensor the run allocates: the init peak (build + initialize), then
  per (checkpointing, seq) after one warm-up step: the forward+backward peak and the optimizer-step peak.
  The whole-run peak is the largest of the three, the quantity the estimator's ``alloc_peak`` predicts.

    DS_ACCELERATOR=cpu python benchmarks/memory_harness.py --out m.json [--quick]

writes the raw measurements as JSON (the test reads them and compares them with the estimate itself).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
import gc
import json
import logging
import math
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from zerorun import memory as M
from zerorun.config import Dtype, ModelConfig, OffloadDevice, ParallelMode, RunConfig, World, default_task, \
    Layout, layouts, make_plan
from zerorun.arch import traits
from zerorun.hardware import GIB, Hardware
from zerorun.telemetry import live_bytes, model_state_bytes

MIB = 2**20
CPU1 = World(nproc_per_node=1, nnodes=1, accelerator="cpu")
CPU_HW = Hardware("cpu", 0, 0, 64 * GIB, 1, 1, fp16_ok=False)
TINY_MODELS = ("tiny-gpt2", "tiny-bert")
REAL_MODELS = ("gpt2", "bert-base-uncased")
STATE_KEYS = ("parameters", "persistent parameters", "parameters (host)", "fp32 master copies",
              "fp32 master copies (host)", "optimizer states", "optimizer states (host)")
"""Estimate entries that make up the persistent model states (gradients apart: they come and go)."""
FWD_BWD_PHASES = ("loss", "backward", "embedding grad", "all-reduce")
"""The estimate's phases inside forward + backward (the all-reduce runs at the end of backward)."""
TARGETS = {"median": 0.05, "worst": 0.10, "under": 0.05}
"""The issue's accuracy targets: median |error| ≤ 5%, worst |error| ≤ 10%, never more than 5% under."""


# ---------------------------------------------------------------------------------------------- configs


def model_file(name: str) -> ModelConfig:
    """A model file of conf/model/ (packaged as zerorun.conf) as a ModelConfig."""
    import importlib.resources

    from omegaconf import OmegaConf

    try:
        conf = importlib.resources.files("zerorun.conf")
    except ModuleNotFoundError:  # zerorun imported from the checkout (benchmarks put it first on sys.path), not
        conf = Path(__file__).resolve().parents[1] / "conf"  # from an editable install that maps conf/
    raw = OmegaConf.load(str(conf / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))


def run_cfg(m: ModelConfig, dtype: Dtype, ckpt: bool, seq: int, micro: int, stage: int = 0,
            offload: OffloadDevice = OffloadDevice.none, params: Optional[bool] = None,
            bucket: Optional[int] = None) -> RunConfig:
    """The RunConfig of one measured point: one rank, no gradient accumulation. ``bucket``: the reduce and
    all-gather bucket size in elements (None: zerorun's default)."""
    cfg = RunConfig(model=m)
    cfg.precision.dtype = Dtype(dtype)
    cfg.trainer.activation_checkpointing = ckpt
    cfg.trainer.micro_batch_size = micro
    cfg.data.seq_len = seq
    cfg.zero.stage = stage
    cfg.offload.device = OffloadDevice(offload)
    cfg.offload.params = params
    cfg.zero.reduce_bucket_size = cfg.zero.allgather_bucket_size = bucket
    cfg.name = m.name
    return cfg


def engine_matrix(quick: bool = False) -> List[Layout]:
    """The layouts of the rule table that run on one CPU rank without a disk (all but NVMe).
    ``quick``: the offloaded ones at ZeRO-2 only."""
    return [lay for lay in layouts(ParallelMode.dp) if lay.device != OffloadDevice.nvme
            and not (quick and lay.device != OffloadDevice.none and lay.stage != 2)]


# ---------------------------------------------------------------------------------------------- torch helpers


def extensions_dir() -> str:
    """The ranks' own torch-extensions dir (zerorun.launcher.extensions_dir): `make ops` built cpu_adam there."""
    from zerorun.launcher import extensions_dir as ranks_dir

    return ranks_dir()


def clear_stale_build_locks(root: str, max_age_s: float = 900) -> None:
    """Remove torch-extension ``lock`` files older than ``max_age_s`` under ``root``: a JIT build killed
    midway leaves its lock behind, and every later process waits on it forever."""
    now = time.time()
    for dirpath, _dirs, files in os.walk(root):
        if "lock" in files:
            lock = os.path.join(dirpath, "lock")
            try:
                if now - os.path.getmtime(lock) > max_age_s:
                    os.remove(lock)
            except OSError:
                pass


def setup_process(threads: int = 1) -> None:
    """Quiet, single-threaded, CPU DeepSpeed. Call before importing deepspeed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    if os.environ["TORCH_EXTENSIONS_DIR"] == extensions_dir():
        clear_stale_build_locks(extensions_dir())
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def torch_dtype(dtype: Dtype):
    import torch

    return {Dtype.fp32: torch.float32, Dtype.bf16: torch.bfloat16, Dtype.fp16: torch.float16}[Dtype(dtype)]


def make_model(m: ModelConfig, dtype: Dtype, ckpt: bool, fast_init: bool = False):
    """The model zerorun.train builds, cast to the module dtype as DeepSpeed does, in train mode.
    ``fast_init``: skip transformers' weight init (10 s for GPT-2 small on one thread) and fill the
    weights with N(0, 0.02): the same tensors, values that do not matter for memory."""
    import contextlib

    import torch

    from zerorun.models import build_model

    torch.manual_seed(0)
    ctx = contextlib.nullcontext()
    if fast_init:
        from transformers.modeling_utils import no_init_weights

        ctx = no_init_weights()
    with ctx:
        model = build_model(m, default_task(m.family), 2)
    if fast_init:
        model.tie_weights()  # skipped with the init: GPT-2's LM head shares wte
        with torch.no_grad():
            for prm in model.parameters():
                prm.normal_(0.0, 0.02)
    model = model.to(torch_dtype(dtype)).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def batch(m: ModelConfig, micro: int, seq: int, device: str = "cpu"):
    """Token ids (no padding, so no attention mask) and labels: an LM batch or a 2-class one."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, min(m.vocab_size, 4000), (micro, seq), generator=g)
    labels = ids if traits(m).decoder else torch.zeros(micro, dtype=torch.long)
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def loss_of(model, inputs):
    return model(**inputs).loss  # like zerorun.train: only the loss survives the call


def saved_activations(model, inputs):
    """Bytes autograd saves in forward: (activations, log_softmax output, loss); unique storages, no params."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen: Dict[int, Tuple[int, str]] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (st.nbytes(), type(t.grad_fn).__name__ if t.grad_fn is not None else "")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, inputs)
    logits = sum(n for n, fn in seen.values() if fn == "LogSoftmaxBackward0")
    return sum(n for n, _ in seen.values()) - logits, logits, loss


def last_block(model):
    if hasattr(model, "transformer"):
        return model.transformer.h[-1]
    return model.model.layers[-1] if hasattr(model, "model") else model.base_model.encoder.layer[-1]


def forward_live(model, inputs) -> int:
    """Bytes alive at the end of a forward (saved activations, checkpoint inputs, the loss's saved
    log_softmax output), made by it; parameters and buffers excluded."""
    lb = live_bytes()
    for t in list(model.parameters()) + list(model.buffers()) + list(inputs.values()):
        lb.add(t, count=False)
    with lb:
        loss = loss_of(model, inputs)
        live = lb.live
    del loss
    return live


def tracked_step(model, inputs):
    """Two accumulating micro-steps; for the 2nd (gradients alive, as with accumulation): the activation
    bytes alive at the end of forward (logits and loss included), the forward/backward peak and the peak
    while the last layer runs backward (recomputed under checkpointing), parameters and buffers excluded."""
    loss_of(model, inputs).backward()  # first micro-step: gradients now exist
    lb = live_bytes()
    for t in list(model.parameters()) + list(model.buffers()) + list(inputs.values()):
        lb.add(t, count=False)
    for p in model.parameters():
        if p.grad is not None:
            lb.add(p.grad)
    grads = lb.live
    layer = {}
    block = last_block(model)

    def pre(_m, _g):
        layer["outer"] = lb.peak
        lb.reset_peak()

    def post(_m, _gi, _go):
        layer["peak"] = lb.peak
        lb.peak = max(lb.peak, layer["outer"])

    hooks = [block.register_full_backward_pre_hook(pre), block.register_full_backward_hook(post)]
    try:
        with lb:
            loss = loss_of(model, inputs)
            end_fwd = lb.live - grads
            loss.backward()
            del loss
    finally:
        for h in hooks:
            h.remove()
    model.zero_grad(set_to_none=True)
    return end_fwd, lb.peak, layer["peak"]


def measure_activations(m: ModelConfig, dtypes: Sequence[Dtype], ckpts: Sequence[bool], seqs: Sequence[int],
                        micro: int, peaks: Sequence[Dtype] = (Dtype.fp32, Dtype.bf16),
                        peak_seqs: Optional[Sequence[int]] = None, fast_init: bool = False) -> List[Dict[str, Any]]:
    """Activation rows for one model, built once in fp32 and cast to each following dtype. The
    forward/backward and last-layer peaks (two more forward+backward passes) only for ``peaks`` dtypes
    and ``peak_seqs`` (None: all)."""
    import torch

    out = []
    model = make_model(m, Dtype.fp32, False, fast_init=fast_init)
    for dtype in dtypes:
        model.to(torch_dtype(dtype))
        for ckpt in ckpts:
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            for seq in seqs:
                inputs = batch(m, micro, seq)
                acts, logits, loss = saved_activations(model, inputs)
                del loss
                row = {"kind": "activations", "model": m.name, "dtype": Dtype(dtype).value, "ckpt": ckpt,
                       "seq": seq, "micro": micro, "activations": acts, "logits": logits, "fwd_bwd": None,
                       "layer": None}
                if dtype in peaks and (peak_seqs is None or seq in peak_seqs):
                    end_fwd, row["fwd_bwd"], row["layer"] = tracked_step(model, inputs)
                elif ckpt:
                    end_fwd = forward_live(model, inputs)
                if ckpt:
                    row["activations"] = end_fwd - logits  # checkpoint inputs are invisible to the pack hook
                out.append(row)
    del model
    gc.collect()
    torch.manual_seed(0)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_rank(backend: str = "gloo") -> None:
    """torch.distributed with world size 1 on a free localhost port, as a zerorun rank starts it."""
    from zerorun.train.trainer import init_distributed

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_distributed(dist_backend=backend, verbose=False)


def engine_model_states(engine, device_type: Optional[str] = None) -> Dict[str, int]:
    """Parameters (persistent ZeRO-3 ones included), fp32 master copies and optimizer states the engine
    holds, in bytes (zerorun.telemetry.model_state_bytes, the same reader summary.json uses)."""
    st = model_state_bytes(engine, device_type)
    return {"parameters": st["parameters"] + st["persistent parameters"],
            "fp32 master copies": st["fp32 master copies"], "optimizer states": st["optimizer states"]}


def measure_engine(m: ModelConfig, layout: Layout, dtype: Dtype, subs: Sequence[Tuple[bool, int]],
                   micro: int, bucket: Optional[int] = None) -> List[Dict[str, Any]]:
    """One real DeepSpeed engine (one rank); a row per (checkpointing, seq) in ``subs``.

    The tracker (``live_bytes``) sees only tensors made after it starts (nothing from earlier engines that DeepSpeed
    keeps referenced). Each row: init peak (model build + deepspeed.initialize), then (after one warm-up
    step, done once: what stays alive between steps does not depend on the batch shape) live bytes before forward, the forward+backward peak, live bytes
    before the step and the optimizer-step peak. Model states are read from the engine's tensors.
    """
    import deepspeed
    import torch

    from zerorun.ds_config import render
    from zerorun.models import build_model

    stage, offload = layout.stage, layout.device
    cfg = run_cfg(m, dtype, False, subs[0][1], micro, stage, offload, layout.params, bucket)
    plan = make_plan(cfg, CPU1)
    bucket = plan.buckets.reduce_bucket_size  # recorded resolved: the estimate must not follow a later default
    ds = render(cfg, plan)
    gc.collect()
    rows = []
    mt = live_bytes()
    with mt:
        torch.manual_seed(0)
        model = build_model(m, default_task(m.family), 2)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
        del model
        init_peak = mt.peak
        for ckpt, seq in subs:
            if ckpt:
                engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                engine.module.gradient_checkpointing_disable()
            inputs = batch(m, micro, seq)
            if not rows:  # warm-up: after one step the optimizer states exist (the steady state)
                engine.backward(engine(**inputs).loss)
                engine.step()
            gc.collect()
            base = mt.reset_peak()
            loss = engine(**inputs).loss
            engine.backward(loss)
            del loss
            fwd_bwd = mt.peak
            step_base = mt.reset_peak()
            engine.step()
            step = mt.peak
            rows.append({"kind": "engine", "model": m.name, "dtype": Dtype(dtype).value, "zero": stage,
                         "offload": OffloadDevice(offload).value, "offload_params": layout.params, "ckpt": ckpt, "seq": seq, "micro": micro,
                         "bucket": bucket, "init": init_peak, "base": base, "fwd_bwd": fwd_bwd, "step_base": step_base,
                         "step": step, "total": max(init_peak, fwd_bwd, step)})
        states = engine_model_states(engine)
        for r in rows:
            r["states"] = states
        engine.destroy()
        del engine
    gc.collect()
    return rows


def pipeline_stage_rows(run_dir: Path) -> List[Dict[str, Any]]:
    """A ``parallel=pipeline`` run made with ZERORUN_TRACK_MEMORY=1: one row per rank, its stage's estimate
    (allocator peak without the process-runtime constant; model states without gradients) and what the
    rank measured (peak live tensor bytes over init and training; DeepSpeed's model-state tensors)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    est = json.loads((run_dir / "estimate.json").read_text())
    from zerorun.memory import OVERHEADS

    rows = []
    for r in summary["peak_memory"]:
        st = est["pipeline_stages"][r["pipeline_stage"]]
        states_est = st["model_state_bytes"] - st["phases"]["backward"].get("gradients", 0)  # grads come and go
        rows.append({
            "stage": st["stage"], "layers": st["layers"], "in_flight": st["in_flight_micro_batches"],
            "est": st["per_rank_peak_bytes"] - sum(v for k, v in st["components"].items() if k in OVERHEADS),
            "phase": st["peak_phase"],
            "measured": max(r["live_tensor_peak_bytes"].values()),
            "states_est": states_est, "states_measured": sum(r["model_state_bytes"].values()),
        })
    return rows


# ---------------------------------------------------------------------------------------------- estimates


def _err(est: float, meas: float) -> float:
    return (est - meas) / meas if meas else (0.0 if est == 0 else math.inf)


def estimate_engine_row(r: Dict[str, Any], m: ModelConfig, world: World = CPU1,
                        hw: Hardware = CPU_HW) -> Dict[str, Any]:
    """The estimate's numbers for a measured engine row (CPU rank: the allocator peak is the phase
    maximum; the process runtime is not a tensor)."""
    cfg = run_cfg(m, Dtype(r["dtype"]), r["ckpt"], r["seq"], r["micro"], r["zero"], OffloadDevice(r["offload"]),
                  r.get("offload_params"), r.get("bucket"))
    est = M.estimate(cfg, make_plan(cfg, world), hw)
    ph = {k: sum(v.values()) for k, v in est.phases.items()}
    step_phase = est.phases["optimizer step"]
    return {"fwd_bwd": max(ph[k] for k in FWD_BWD_PHASES if k in ph),
            "step": ph["optimizer step"], "total": max(ph.values()), "phase": est.peak_phase,
            "states": sum(v for k, v in step_phase.items() if k in STATE_KEYS)}


def estimate_activation_row(r: Dict[str, Any], m: ModelConfig) -> Dict[str, Any]:
    """The estimate's activations, logits and forward/backward peak (parameters and buffers excluded) for
    a measured activation row: ZeRO-0 on one CPU rank, gradient accumulation 2 (gradients alive)."""
    dtype, micro, seq = Dtype(r["dtype"]), r["micro"], r["seq"]
    act = M.activations(m, micro, seq, dtype, "cpu", r["ckpt"])
    cfg = run_cfg(m, dtype, r["ckpt"], seq, micro)
    cfg.trainer.global_batch_size = 2 * micro  # the measured step is the 2nd of two accumulating micro-steps
    est = M.estimate(cfg, make_plan(cfg, CPU1), CPU_HW)
    fb = [ph for name, ph in est.phases.items() if name in ("loss", "backward", "embedding grad")]
    states = ("parameters", "buffers", "fp32 master copies", "optimizer states")
    lm = traits(m).decoder
    return {"activations": act.saved, "logits": 4 * micro * seq * m.vocab_size if lm else 0,
            "fwd_bwd": max(sum(v for k, v in ph.items() if k not in states) for ph in fb),
            "layer": sum(v for k, v in est.phases["backward"].items() if k not in states)}


# ---------------------------------------------------------------------------------------------- the table


def pct(e: float) -> str:
    return "    n/a" if math.isinf(e) else f"{100 * e:+6.1f}%"


def cell(est: float, meas: float, width: int = 8) -> str:
    return f"{est / MIB:{width}.2f} {meas / MIB:{width}.2f} {pct(_err(est, meas))}"


def engine_table(rows: Iterable[Tuple[Dict[str, Any], Dict[str, Any]]], unit: str = "MiB") -> List[str]:
    """Lines of the engine table: (measured, estimated) pairs, each quantity as estimate, measured, error."""
    hdr = (f"{'model':17s} {'dtype':5s} {'zero':>4s} {'offload':7s} {'ckpt':4s} {'seq':>4s} | "
           f"{'states est':>10s} {'meas':>8s} {'err':>7s} | {'fwd+bwd est':>11s} {'meas':>8s} {'err':>7s} | "
           f"{'step est':>8s} {'meas':>8s} {'err':>7s} | {'TOTAL est':>9s} {'meas':>8s} {'err':>7s}  peak phase")
    lines = [hdr + f"   ({unit})", "-" * len(hdr)]
    for r, e in rows:
        states = sum(r["states"].values())
        offload = r["offload"] + ("+p" if r.get("offload_params") else "")
        lines.append(f"{r['model']:17s} {r['dtype']:5s} {r['zero']:4d} {offload:7s} "
                     f"{'on' if r['ckpt'] else 'off':4s} {r['seq']:4d} | {cell(e['states'], states, 10)} | "
                     f"{cell(e['fwd_bwd'], r['fwd_bwd'], 11)} | {cell(e['step'], r['step'])} | "
                     f"{cell(e['total'], r['total'], 9)}  {e['phase']}")
    return lines


def activation_table(rows: Iterable[Tuple[Dict[str, Any], Dict[str, Any]]]) -> List[str]:
    hdr = (f"{'model':17s} {'dtype':5s} {'micro':>5s} {'ckpt':4s} {'seq':>4s} | {'act est':>8s} {'meas':>8s} "
           f"{'err':>7s} | {'logit est':>9s} {'meas':>8s} {'err':>7s} | {'fwd+bwd est':>11s} {'meas':>8s} "
           f"{'err':>7s} | {'layer est':>9s} {'meas':>8s} {'err':>7s}")
    lines = [hdr + "   (MiB)", "-" * len(hdr)]
    for r, e in rows:
        logit = cell(e["logits"], r["logits"], 9) if e["logits"] else f"{'-':>9s} {'-':>8s} {'':7s}"
        none = lambda w: f"{'-':>{w}s} {'-':>8s} {'':7s}"  # noqa: E731
        fb = cell(e["fwd_bwd"], r["fwd_bwd"], 11) if r["fwd_bwd"] is not None else none(11)
        layer = cell(e["layer"], r["layer"], 9) if r["layer"] is not None else none(9)
        lines.append(f"{r['model']:17s} {r['dtype']:5s} {r['micro']:5d} {'on' if r['ckpt'] else 'off':4s} "
                     f"{r['seq']:4d} | {cell(e['activations'], r['activations'])} | {logit} | {fb} | {layer}")
    return lines


@dataclass
class Accuracy:
    """Signed relative errors (estimate − measured) / measured of one quantity over a matrix."""

    name: str
    errors: List[float]

    @property
    def median_abs(self) -> float:
        return statistics.median(abs(e) for e in self.errors)

    @property
    def worst_abs(self) -> float:
        return max(abs(e) for e in self.errors)

    @property
    def most_under(self) -> float:
        """The largest under-estimate as a positive fraction (0 when the estimate is never below)."""
        return max(0.0, -min(self.errors))

    @property
    def under_rate(self) -> float:
        return sum(e < 0 for e in self.errors) / len(self.errors)

    def failures(self, targets: Dict[str, float] = TARGETS) -> List[str]:
        out = []
        if self.median_abs > targets["median"]:
            out.append(f"median |error| {100 * self.median_abs:.1f}% > {100 * targets['median']:.0f}%")
        if self.worst_abs > targets["worst"]:
            out.append(f"worst |error| {100 * self.worst_abs:.1f}% > {100 * targets['worst']:.0f}%")
        if self.most_under > targets["under"]:
            out.append(f"under-estimates by up to {100 * self.most_under:.1f}% > {100 * targets['under']:.0f}%")
        return out

    def line(self) -> str:
        verdict = "; ".join(self.failures()) or "meets the targets"
        return (f"{self.name}: n={len(self.errors)}, median |error| {100 * self.median_abs:.2f}%, worst "
                f"{100 * self.worst_abs:.2f}%, largest under-estimate {100 * self.most_under:.2f}% "
                f"(under in {100 * self.under_rate:.0f}% of rows) -> {verdict}")


# ---------------------------------------------------------------------------------------------- the report


def report(data: Dict[str, Any], elapsed: Optional[float] = None) -> Tuple[List[str], Dict[str, Accuracy], Dict]:
    """The tables and the accuracy summary of a run_matrix() result: (lines, accuracy by quantity, rows)."""
    models: Dict[str, ModelConfig] = {}

    def model(name):
        if name not in models:
            models[name] = model_file(name)
        return models[name]

    acts = [(r, estimate_activation_row(r, model(r["model"]))) for r in data["activations"]]
    engines = [(r, estimate_engine_row(r, model(r["model"]))) for r in data["engines"]]
    quantities = {
        "TOTAL (whole-run peak, engine)": [(e["total"], r["total"]) for r, e in engines],
        "fwd+bwd peak (engine)": [(e["fwd_bwd"], r["fwd_bwd"]) for r, e in engines],
        "optimizer-step peak (engine)": [(e["step"], r["step"]) for r, e in engines],
        "model states (engine)": [(e["states"], sum(r["states"].values())) for r, e in engines],
        "saved activations": [(e["activations"], r["activations"]) for r, e in acts],
        "fwd+bwd peak (plain model)": [(e["fwd_bwd"], r["fwd_bwd"]) for r, e in acts if r["fwd_bwd"] is not None],
    }
    accuracy = {name: Accuracy(name, [_err(est, meas) for est, meas in pairs]) for name, pairs in quantities.items()}
    took = f"; measured in {elapsed:.0f} s" if elapsed else ""
    lines = [f"zerorun.memory vs CPU measurements ({data['versions']}){took} "
             f"(activations {data['timing']['activations_s']:.0f} s, engines {data['timing']['engines_s']:.0f} s)",
             "", "Activations on a plain HF model, ZeRO-0 semantics, 2nd of two accumulating micro-steps:"]
    lines += activation_table(acts)
    lines += ["", "Real DeepSpeed engine, 1 CPU rank (each cell: estimate, measured, error; TOTAL = max(init, "
                  "fwd+bwd, step)):"]
    lines += engine_table(engines)
    lines += ["", "Accuracy (targets: median |error| <= 5%, worst <= 10%, never more than 5% under):"]
    lines += [f"  {a.line()}" for a in accuracy.values()]
    return lines, accuracy, {"acts": acts, "engines": engines}


# ---------------------------------------------------------------------------------------------- CLI


def run_matrix(*, tiny: Sequence[str], real: Sequence[str], dtypes: Sequence[Dtype], seqs: Sequence[int],
               real_seqs: Sequence[int], micro: int, quick: bool, bucket: Optional[int] = None,
               log=print) -> Dict[str, Any]:
    """Every measurement of the validation matrix (see the module docstring)."""
    t0 = time.perf_counter()
    out: Dict[str, Any] = {"activations": [], "engines": [], "timing": {}}
    import torch

    out["versions"] = {"torch": torch.__version__}
    ckpts = (False, True)
    for name in tiny:
        out["activations"] += measure_activations(model_file(name), dtypes, ckpts, seqs, micro)
    log(f"  tiny activations: {time.perf_counter() - t0:.1f} s")
    for name in real:
        t = time.perf_counter()
        out["activations"] += measure_activations(model_file(name), dtypes, ckpts, real_seqs, 1,
                                                  peaks=(Dtype.fp32,), peak_seqs=real_seqs[:1], fast_init=True)
        log(f"  {name} activations (micro-batch 1): {time.perf_counter() - t:.1f} s")
    out["timing"]["activations_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    import deepspeed

    out["versions"]["deepspeed"] = deepspeed.__version__
    init_single_rank()
    subs = [(ckpt, seq) for ckpt in ckpts for seq in seqs]
    for name in tiny:
        m = model_file(name)
        for dtype in dtypes:
            for lay in engine_matrix(quick):
                t = time.perf_counter()
                out["engines"] += measure_engine(m, lay, dtype, subs, micro, bucket)
                log(f"  {name} {Dtype(dtype).value} ZeRO-{lay.stage} offload {lay.label}: {time.perf_counter() - t:.1f} s")
    out["timing"]["engines_s"] = time.perf_counter() - t1
    out["timing"]["total_s"] = time.perf_counter() - t0
    return out


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description="Measure zerorun.memory's quantities on CPU; write them as JSON.")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--tiny", default=",".join(TINY_MODELS), help="models for the full matrix (conf/model names)")
    ap.add_argument("--real", default=",".join(REAL_MODELS),
                    help="real-size models, activations only, micro-batch 1 ('' for none)")
    ap.add_argument("--seqs", default="64,256")
    ap.add_argument("--real-seqs", default="64,128")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="offload=cpu with ZeRO-2 only")
    ap.add_argument("--bucket", type=int, default=None,
                    help="reduce/all-gather bucket size in elements for the engines (default: zerorun's)")
    ap.add_argument("--print", action="store_true", help="also print the tables and the accuracy summary")
    args = ap.parse_args(argv)
    setup_process()
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    res = run_matrix(tiny=split(args.tiny), real=split(args.real), dtypes=[Dtype.fp32, Dtype.bf16],
                     seqs=[int(s) for s in split(args.seqs)], real_seqs=[int(s) for s in split(args.real_seqs)],
                     micro=args.micro, quick=args.quick, bucket=args.bucket, log=lambda s: print(s, file=sys.stderr, flush=True))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    if args.print:
        print("\n".join(report(res, res["timing"]["total_s"])[0]))


if __name__ == "__main__":
    main()

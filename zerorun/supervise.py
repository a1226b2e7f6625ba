"""The launcher's loop around the ranks: start them, read why they stopped, then recover or stop.

    attempt → ranks exit → classify (summary / fault records / exit code) → decide (pure) → relaunch or stop

OOM: relaunch from the last complete checkpoint with the micro-batch halved and accumulation doubled (same
global batch, same data order), at micro-batch 1 the gate's next repair (``trainer.oom_retries``).
Preemption (SIGTERM/SIGUSR1/SIGUSR2 to zerorun or to the ranks): the ranks save and stop; zerorun exits 75.
A rank that died (``trainer.max_restarts``): relaunch from the last complete checkpoint after a back-off,
unless it died at the same step as last time. Every event goes to recoveries.json and summary.json.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from . import checkpoint, faults, launcher
from .config import Plan, RunConfig
from .memory import Change, runtime_oom_repair
from .rundir import RunDir


@dataclass
class Launch:
    """One prepared attempt: the config and plan its run dir holds, and the command that starts the ranks."""

    cfg: RunConfig
    plan: Plan
    argv: List[str]
    env: Dict[str, str]
    master_addr: str
    master_port: int
    estimate_bytes: int = 0
    resume: Optional[dict] = None
    """The checkpoint this attempt resumes from (a relaunch falls back to it when the run saved none)."""


@dataclass
class Ended:
    """How an attempt ended, from what the ranks left behind."""

    rc: int
    completed: bool
    records: List[Dict[str, Any]] = field(default_factory=list)
    last_step: int = 0
    signalled: Optional[str] = None  # zerorun itself got a stop signal during the attempt

    def kind(self) -> str:
        kinds = {r.get("kind") for r in self.records}
        if self.completed:
            return "completed"
        if "preflight" in kinds:
            return "preflight"
        if "disk_full" in kinds:  # before a signal: the launcher's teardown of the other ranks looks like one
            return "disk_full"
        if "preempted" in kinds or self.signalled:  # the node is going away: no relaunch here
            return "preempted"
        if "oom" in kinds:
            return "oom"
        return "crashed"


@dataclass
class Verdict:
    action: str  # "done" | "relaunch" | "stop"
    code: int
    reason: str
    cfg: Optional[RunConfig] = None
    changes: List[Change] = field(default_factory=list)
    wait_s: float = 0.0


def decide(launch: Launch, ended: Ended, history: List[Dict[str, Any]]) -> Verdict:
    """What to do after an attempt (pure): ``history`` is the recoveries so far."""
    tr = launch.cfg.trainer
    kind = ended.kind()
    if kind == "completed":
        return Verdict("done", faults.EXIT_OK, "completed")
    if kind == "preflight":
        rec = next(r for r in ended.records if r.get("kind") == "preflight")
        return Verdict("stop", faults.EXIT_BAD_INPUT, "the nodes differ: " + " | ".join(rec.get("problems", []))
                       + ". Install the same software and pass the same overrides and data on every node")
    if kind == "disk_full":
        rec = next(r for r in ended.records if r.get("kind") == "disk_full")
        newest = f"step {rec['latest'].replace('global_step', '')}" if rec.get("latest") else "none"
        return Verdict("stop", faults.EXIT_DISK_FULL, f"disk full at {rec.get('path')} while saving step "
                       f"{rec.get('step')}; the newest complete checkpoint is {newest}. Free space there (or point "
                       "trainer.checkpoint_dir at a larger disk), then rerun with trainer.resume=true")
    if kind == "preempted":
        return Verdict("stop", faults.EXIT_PREEMPTED, "stopped by a signal; rerun the same command with "
                       "trainer.resume=true to continue from the checkpoint")
    if launch.cfg.launcher.nnodes > 1:
        # Every node's zerorun would decide on its own over a shared run dir: relaunching stays with the
        # user (or the scheduler), all nodes together.
        code = faults.EXIT_OOM if kind == "oom" else faults.EXIT_FAILED
        return Verdict("stop", code, f"{'a rank ran out of memory' if kind == 'oom' else 'a rank failed'} in a "
                       "multi-node job: rerun it on every node with trainer.resume=true (and a smaller "
                       "trainer.micro_batch_size after an OOM)")
    if kind == "oom":
        oom = next(r for r in ended.records if r.get("kind") == "oom")
        where = f"rank {oom.get('rank')} ran out of memory at step {oom.get('step', '?')}"
        used = sum(e["kind"] == "oom" for e in history)
        if used >= tr.oom_retries:
            return Verdict("stop", faults.EXIT_OOM, f"{where}; trainer.oom_retries={tr.oom_retries} recoveries "
                           "used. Lower trainer.micro_batch_size or raise zero.stage / offload and resume")
        repair = runtime_oom_repair(launch.cfg, launch.plan)
        if repair is None:
            return Verdict("stop", faults.EXIT_OOM, f"{where}, and nothing is left for zerorun to change "
                           "(micro-batch 1, checkpointing, ZeRO-3, offload): use fewer/larger-memory ranks")
        return Verdict("relaunch", faults.EXIT_OOM, where, cfg=repair[0], changes=repair[1])
    # A rank died without a record: a kill, a segfault, a lost peer.
    restarts = [e for e in history if e["kind"] == "restart"]
    if len(restarts) >= tr.max_restarts:
        hint = "" if tr.max_restarts else "; trainer.max_restarts=N restarts it from the last checkpoint"
        return Verdict("stop", faults.EXIT_FAILED, f"a rank failed (launcher exit {ended.rc}){hint}")
    if restarts and restarts[-1].get("step") == ended.last_step:
        return Verdict("stop", faults.EXIT_FAILED, f"a rank failed again at step {ended.last_step}, as before the "
                       "last restart: not a transient fault, so no further restarts")
    wait = min(300.0, tr.restart_backoff_s * 2 ** len(restarts))
    return Verdict("relaunch", faults.EXIT_FAILED, f"a rank failed at step {ended.last_step + 1} "
                   f"(launcher exit {ended.rc})", cfg=launch.cfg, wait_s=wait)


def _run_ranks(launch: Launch, run_dir: RunDir, say: Callable[[str], None], got: List[str]) -> Ended:
    """Start the ranks and wait. A stop signal to zerorun (``got``, filled by the handler ``supervise``
    installs) becomes the run dir's stop request: the ranks save at the next step and exit, with no
    launcher timeout to race (torchrun, the deepspeed CLI)."""
    faults.clear(run_dir.path)
    run_dir.clear_outcome()
    # Ranks that finished cleanly say so (faults.mark_clean_exit) under this node's key. Not where the deepspeed
    # CLI starts other hosts' ranks over pdsh: those are still running when this host's are done.
    key = f"{socket.gethostname()}-{os.getpid()}"
    nproc = launch.plan.world.nproc_per_node
    finished = None if launch.cfg.launcher.hostfile else (lambda: faults.clean_exits(run_dir.path, key) >= nproc)
    rc = launcher.run(launch.argv, {**launch.env, faults.NODE_KEY_ENV: key}, finished)
    faults.forget_clean_exits(run_dir.path, key)
    # No orphans: ranks a dead launcher left behind get the stop grace (they may be saving), then SIGKILL.
    killed = launcher.reap(str(run_dir.path.resolve()), launch.cfg.launcher.stop_timeout_s if got else 10.0)
    if killed:
        say(f"killed {killed} rank process(es) the launcher left behind")
    if launch.plan.world.accelerator == "cpu":  # ranks skip the op that makes these (train.trainer.init_distributed);
        # a DeepSpeed that loaded it elsewhere would leave ~66 MB per rank in /dev/shm until reboot
        launcher.release_cpu_shm(launch.master_addr, launch.master_port)
    steps = [r["step"] for r in run_dir.read_metrics()]
    completed = run_dir.read_summary() is not None
    if rc == 0 and not completed:
        # The deepspeed CLI can exit 0 when a rank died without a trace; success is the summary.
        say("the launcher exited 0 but no rank wrote summary.json: treating the run as failed.")
    records = faults.read_all(run_dir.path)
    if rc == faults.EXIT_DISK_FULL and not any(r.get("kind") == "disk_full" for r in records):
        # The ranks said it with their exit code, and the full disk held the run dir too (no room for a record).
        root = run_dir.checkpoints_for(launch.cfg)
        records.append({"kind": "disk_full", "rank": None, "path": str(root), "latest": checkpoint.latest_tag(root),
                        "step": max(steps) if steps else "?"})
    return Ended(rc=rc, completed=completed, records=records,
                 last_step=max(steps) if steps else 0, signalled=got[0] if got else None)


def supervise(first: Launch, run_dir: RunDir, relaunch: Callable[[RunConfig, Optional[dict]], Launch],
              say: Callable[[str], None]) -> int:
    """Attempts until the run completes or a verdict stops it; returns zerorun's exit code."""
    got: List[str] = []

    def on_signal(signum, _frame):
        name = signal.Signals(signum).name
        if not got:
            say(f"{name}: asking the ranks to save a checkpoint at the next step and stop ...")
        got.append(name)
        faults.request_stop(run_dir.path, name)

    previous = {s: signal.signal(getattr(signal, s), on_signal) for s in faults.STOP_SIGNALS}
    try:
        return _attempts(first, run_dir, relaunch, say, got)
    finally:
        for s, h in previous.items():
            signal.signal(getattr(signal, s), h)


def _attempts(first: Launch, run_dir: RunDir, relaunch: Callable[[RunConfig, Optional[dict]], Launch],
              say: Callable[[str], None], got: List[str]) -> int:
    from .config import UserError

    launch, attempt = first, 1
    while True:
        ended = _run_ranks(launch, run_dir, say, got)
        history = run_dir.read_recoveries()
        verdict = decide(launch, ended, history)
        if verdict.action == "done":
            _finish(run_dir, history, say)
            return faults.EXIT_OK
        event = _event(attempt, ended, verdict, launch)
        run_dir.append_recovery(event)
        if verdict.action == "stop":
            say(f"{verdict.reason}. Run dir: {run_dir.path}")
            return verdict.code
        point, skipped = checkpoint.resume_point([run_dir.checkpoints_for(launch.cfg)])
        for why in skipped:
            say(f"passing over a damaged checkpoint: {why}")
        # Nothing saved by this run yet: the checkpoint it started from (another run's, or a converted one).
        resume = {"checkpoint_dir": str(point[0].resolve()), "tag": point[1]} if point else launch.resume
        if verdict.changes:
            say(f"{verdict.reason}; relaunching with " + ", ".join(
                f"{c.key} {c.old} → {c.new} ({c.why})" for c in verdict.changes))
        else:
            say(f"{verdict.reason}; restarting in {verdict.wait_s:.0f} s "
                f"(restart {sum(e['kind'] == 'restart' for e in history) + 1} of {launch.cfg.trainer.max_restarts})")
            deadline = time.monotonic() + verdict.wait_s
            while not got and time.monotonic() < deadline:
                time.sleep(min(1.0, verdict.wait_s))
        if got:  # stopped between attempts: the last checkpoint stands
            run_dir.append_recovery({"kind": "preempted", "attempt": attempt, "signal": got[0],
                                     "time": time.strftime("%Y-%m-%d %H:%M:%S"), "step": ended.last_step})
            say(f"{got[0]} before the relaunch: stopping; resume with trainer.resume=true. Run dir: {run_dir.path}")
            return faults.EXIT_PREEMPTED
        say(f"resuming from {resume['checkpoint_dir']}/{resume['tag']}" if resume
            else "no complete checkpoint yet: starting over")
        try:
            launch = relaunch(verdict.cfg, resume)
        except UserError as e:  # e.g. the gate refuses the repaired config
            say(f"cannot relaunch: {e}. Run dir: {run_dir.path}")
            return verdict.code
        attempt += 1


def _event(attempt: int, ended: Ended, verdict: Verdict, launch: Launch) -> Dict[str, Any]:
    kind = {"oom": "oom", "preempted": "preempted", "disk_full": "disk_full"}.get(ended.kind(), "restart" if verdict.action == "relaunch"
                                                        else "failed")
    rec = next((r for r in ended.records if r.get("kind") == ended.kind()), {})
    event = {"kind": kind, "attempt": attempt, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
             "rank": rec.get("rank"), "step": rec.get("step", ended.last_step), "launcher_exit": ended.rc,
             "action": verdict.action, "reason": verdict.reason,
             "changes": [{"key": c.key, "old": _plain(c.old), "new": _plain(c.new), "why": c.why,
                          "override": c.override()} for c in verdict.changes]}
    if kind == "oom":  # what ran out, next to what the gate predicted for that config
        event.update(estimate_bytes=launch.estimate_bytes, measured=rec.get("rss"), device=rec.get("device"),
                     error=rec.get("error"), micro_batch_size=rec.get("micro_batch_size"))
    if kind == "preempted":
        event.update(signal=rec.get("signal") or ended.signalled, checkpoint=rec.get("checkpoint"))
    return {k: v for k, v in event.items() if v is not None}


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # enums as their config spelling


def _finish(run_dir: RunDir, history: List[Dict[str, Any]], say: Callable[[str], None]) -> None:
    """A completed run: its recoveries go into summary.json and the end-of-run line."""
    if not history:
        return
    summary = run_dir.read_summary() or {}
    summary["recoveries"] = history
    run_dir.write_summary(summary)
    names = {"oom": ("out-of-memory recovery", "out-of-memory recoveries"), "restart": ("restart", "restarts"),
             "preempted": ("preemption", "preemptions")}
    parts = [f"{n} {names[k][n > 1]}" for k in names if (n := sum(e["kind"] == k for e in history))]
    changes = list({c["key"]: c["override"] for e in history for c in e.get("changes", [])}.values())
    say("completed after " + ", ".join(parts) + (f"; config changes kept: {' '.join(changes)}" if changes else "")
        + " (recoveries.json, summary.json)")


def recorded_changes(run_dir) -> List[Dict[str, Any]]:
    """The config changes earlier OOM recoveries of a run made (a later resume of it makes them again)."""
    try:
        events = RunDir(run_dir).read_recoveries()
    except (OSError, ValueError):
        return []
    return [c for e in events for c in e.get("changes", [])]


def apply_changes(cfg: RunConfig, changes: List[Dict[str, Any]]) -> RunConfig:
    from omegaconf import OmegaConf

    from .config import to_run_config

    tree = OmegaConf.structured(cfg)
    for c in changes:
        OmegaConf.update(tree, c["key"], c["new"], merge=False)
    return to_run_config(tree)

"""What the launcher does after an attempt (zerorun.supervise.decide, pure), the runtime OOM repair ladder,
the fault records, and checkpoint manifests (damage is named; the previous complete tag is used)."""
import json

import pytest

from helpers import CPU2, planned, repair_ladder
from zerorun import checkpoint, faults
from zerorun.config import make_plan
from zerorun.memory import runtime_oom_repair
from zerorun.supervise import Ended, Launch, apply_changes, decide


def launch(*overrides):
    cfg, plan = planned("+model=tiny-gpt2", *overrides, world=CPU2)
    return Launch(cfg=cfg, plan=plan, argv=[], env={}, master_addr="127.0.0.1", master_port=1)


def oom(step=5):
    return {"kind": "oom", "rank": 1, "step": step}


@pytest.mark.heavy
def test_oom_halves_the_micro_batch_and_keeps_the_global_batch():
    first = launch("trainer.micro_batch_size=8")
    v = decide(first, Ended(rc=3, completed=False, records=[oom()]), history=[])
    assert v.action == "relaunch" and v.code == faults.EXIT_OOM
    assert v.cfg.trainer.micro_batch_size == 4 and v.cfg.trainer.global_batch_size == 16
    _, plan = planned("+model=tiny-gpt2", *[c.override() for c in v.changes], world=CPU2)
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.global_batch_size) == (4, 2, 16)


def test_at_micro_batch_one_the_repair_climbs_the_gates_ladder():
    steps = repair_ladder("+model=tiny-gpt2", "trainer.micro_batch_size=1", "zero=stage1")
    assert all(cfg.trainer.micro_batch_size == 1 for cfg, _ in steps)
    seen = [f"{c.key}={c.new}" for _, changes in steps for c in changes]
    # checkpointing, hidden²-sized buckets (the default holds the whole model), then each ZeRO stage, optimizer
    # offload, then parameters too; never back down (CPU ranks take the fused loss by themselves, and the model's
    # own at ZeRO-3)
    assert seen == ["trainer.activation_checkpointing=True", "zero.reduce_bucket_size=16384",
                    "zero.allgather_bucket_size=16384", "zero.stage=2", "zero.stage=3",
                    "offload.device=OffloadDevice.cpu", "offload.params=False", "offload.params=True"]
    assert [cfg.trainer.fused_loss for cfg, _ in steps] == [None] * len(steps)
    last = steps[-1][0]
    assert runtime_oom_repair(last, make_plan(last, CPU2)) is None  # nothing left: the launcher stops with EXIT_OOM


def test_oom_retries_are_capped():
    history = [{"kind": "oom"}] * 3
    v = decide(launch("trainer.micro_batch_size=8"), Ended(rc=3, completed=False, records=[oom()]), history)
    assert v.action == "stop" and v.code == faults.EXIT_OOM and "oom_retries=3" in v.reason


@pytest.mark.heavy
def test_preemption_stops_with_the_resumable_code():
    ended = Ended(rc=1, completed=False, records=[{"kind": "preempted", "rank": 0, "step": 4}])
    v = decide(launch(), ended, [])
    assert (v.action, v.code) == ("stop", faults.EXIT_PREEMPTED) and "trainer.resume=true" in v.reason
    assert decide(launch(), Ended(rc=1, completed=False, signalled="SIGTERM"), []).code == faults.EXIT_PREEMPTED


@pytest.mark.heavy
def test_restarts_back_off_and_stop_when_the_failure_repeats_at_the_same_step():
    ended = Ended(rc=1, completed=False, last_step=5)
    assert decide(launch(), ended, []).action == "stop"  # max_restarts defaults to 0
    first = launch("trainer.max_restarts=3", "trainer.restart_backoff_s=2")
    v = decide(first, ended, [])
    assert v.action == "relaunch" and v.wait_s == 2 and v.cfg == first.cfg
    v = decide(first, Ended(rc=1, completed=False, last_step=9), [{"kind": "restart", "step": 5}])
    assert v.action == "relaunch" and v.wait_s == 4
    v = decide(first, ended, [{"kind": "restart", "step": 5}])
    assert v.action == "stop" and "again at step 5" in v.reason
    assert decide(first, Ended(rc=0, completed=True), []).action == "done"


@pytest.mark.heavy
def test_recorded_changes_apply_to_a_later_resume():
    cfg = launch("trainer.micro_batch_size=8").cfg
    again = apply_changes(cfg, [{"key": "trainer.micro_batch_size", "new": 2},
                                {"key": "offload.device", "new": "cpu"}])
    assert again.trainer.micro_batch_size == 2 and again.offload.device.value == "cpu"


@pytest.mark.heavy
def test_oom_is_recognised_from_what_allocators_raise():
    assert faults.is_oom(MemoryError())
    assert faults.is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate "
                                      "memory: you tried to allocate 4194304 bytes. Error code 12"))
    assert not faults.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    torch = pytest.importorskip("torch")
    assert faults.is_oom(torch.OutOfMemoryError("CUDA out of memory"))


def test_fault_records_round_trip_and_clear(tmp_path):
    faults.record(tmp_path, 1, "oom", step=3)
    faults.record(tmp_path, 0, "preempted", step=3)
    faults.request_stop(tmp_path, "SIGTERM")
    assert [r["rank"] for r in faults.read_all(tmp_path)] == [0, 1] and faults.stop_requested(tmp_path)
    faults.clear(tmp_path)
    assert faults.read_all(tmp_path) == [] and not faults.stop_requested(tmp_path)


def _saved(root, step, files):
    tag = root / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    for name, data in files.items():
        (tag / name).write_bytes(data)
    (tag / checkpoint.COMPLETE).write_text(json.dumps({"step": step, "files": checkpoint.manifest(tag)}))
    (root / checkpoint.LATEST).write_text(tag.name)
    return tag


@pytest.mark.parametrize("harm", ["flip", "truncate", "missing"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_used(tmp_path, harm):
    root = tmp_path / "checkpoints"
    _saved(root, 2, {"mp_rank_00_model_states.pt": b"a" * 100})
    newest = _saved(root, 4, {"mp_rank_00_model_states.pt": b"b" * 100, "rng_rank1.pt": b"r" * 10})
    assert checkpoint.resume_point([tmp_path]) == ((root, "global_step4"), [])
    shard = newest / "mp_rank_00_model_states.pt"
    if harm == "flip":
        shard.write_bytes(b"b" * 50 + b"c" + b"b" * 49)
    elif harm == "truncate":
        shard.write_bytes(b"b" * 60)
    else:
        shard.unlink()
    found, skipped = checkpoint.resume_point([tmp_path])
    assert found == (root, "global_step2")
    assert len(skipped) == 1 and str(shard) in skipped[0]
    assert {"flip": "corrupted", "truncate": "truncated", "missing": "missing"}[harm] in skipped[0]

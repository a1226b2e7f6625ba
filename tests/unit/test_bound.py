"""The bound the gate decides on (zerorun/memory/bound.py): above the point, as wide as each term is uncertain."""
import dataclasses

import pytest
from hypothesis import assume, given, settings, strategies as st

from helpers import A100_8, CPU2, CPU_HOST, GPU8, composed
from zerorun import memory as M
from zerorun.config import make_plan
from zerorun.hardware import GIB
from zerorun.memory.bound import term_widths, upper_bound
from zerorun.memory.priors import OVERHEADS

TERMS = st.dictionaries(st.sampled_from(["parameters", "activations", "logits + loss", *OVERHEADS]),
                        st.integers(0, 2**40), max_size=8)


@settings(max_examples=300, deadline=None)
@given(components=TERMS, accelerator=st.sampled_from(["cpu", "cuda"]), measured=st.booleans(),
       mmap=st.sampled_from([1 << 20, 32 << 20, 1 << 62]), calibrated=st.booleans())
def test_the_bound_is_never_below_the_point_and_grows_with_any_term(components, accelerator, measured, mmap,
                                                                    calibrated):
    point = sum(components.values())
    widths = term_widths(components, accelerator=accelerator, process_measured=measured, mmap_threshold=mmap,
                         calibrated=calibrated)
    bound = upper_bound(point, widths)
    assert point <= bound <= point + sum(widths.values()) + 1
    for name in components:
        more = dict(components, **{name: components[name] + 2**30})
        wider = upper_bound(point + 2**30, term_widths(more, accelerator=accelerator, process_measured=measured,
                                                       mmap_threshold=mmap, calibrated=calibrated))
        assert wider >= bound, name


def est(cfg, world=CPU2, hw=CPU_HOST, cal=M.DEFAULT_CALIBRATION):
    return M.estimate(cfg, make_plan(cfg, world), hw, cal=cal)


def at_mmap(cfg, mib):
    return dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, mmap_threshold_mib=mib))


def test_what_was_measured_is_tight_and_priors_are_wide():
    cfg = composed("+model=gpt2", "precision=bf16", "data.seq_len=256", "trainer.micro_batch_size=2")
    prior, measured = est(at_mmap(cfg, 1)), est(at_mmap(cfg, 1), cal=dataclasses.replace(M.DEFAULT_CALIBRATION,
                                                                                          process_measured=True))
    assert prior.bound_widths["process runtime"] > measured.bound_widths["process runtime"] > 0
    # At the validated 1 MiB threshold the bound is within 10% of the point; mmap off leaves the heap to the
    # allocation order, and its bound says so.
    assert measured.bound_bytes <= 1.10 * measured.per_rank_peak_bytes
    off = est(at_mmap(cfg, 0), cal=dataclasses.replace(M.DEFAULT_CALIBRATION, process_measured=True))
    assert off.bound_widths["heap (mmap off or 32 MiB, not validated)"] > 0.5 * (off.bound_bytes - off.per_rank_peak_bytes)
    # GPU: the CUDA context and NCCL are priors until a GPU calibration measures them.
    gpu = M.estimate(cfg, make_plan(cfg, GPU8), A100_8)
    assert {"CUDA context", "NCCL buffers", "allocator margin"} <= set(gpu.bound_widths)
    assert gpu.bound_bytes - gpu.per_rank_peak_bytes > 1 * GIB


def test_the_gate_decides_on_the_bound_and_says_both():
    cfg = at_mmap(composed("+model=gpt2", "data.seq_len=256", "trainer.micro_batch_size=2", "gate=strict"), 1)
    e = est(cfg)
    plan = make_plan(cfg, CPU2)
    between = dataclasses.replace(CPU_HOST, host_mem_bytes=int((e.per_rank_peak_bytes + e.bound_bytes) / 2 * 2))
    refused = M.gate(cfg, plan, between)
    assert not refused.estimate.fits and refused.estimate.per_rank_peak_bytes <= refused.estimate.device_capacity_bytes
    assert "at most" in refused.message
    roomy = dataclasses.replace(CPU_HOST, host_mem_bytes=int(e.bound_bytes * 2 * 1.01))
    ok = M.gate(cfg, plan, roomy)
    assert ok.ok and f"at most {e.bound_bytes / GIB:.2f} GiB" in ok.message
    j = ok.estimate.to_json()
    assert j["per_rank_bound_bytes"] == e.bound_bytes and j["bound_widths"] == e.bound_widths


def test_a_stored_process_baseline_is_used_only_in_the_boot_it_was_measured(tmp_path, monkeypatch):
    """Ranks sat at 428 MiB "ready" while a baseline stored in an earlier boot said 495 MiB: every tiny model read
    9-14% over. A baseline from another boot or other software is measured again, not trusted."""
    import json

    from zerorun import calibration as C
    from zerorun.hardware import Hardware

    monkeypatch.setenv("ZERORUN_CACHE", str(tmp_path))
    cfg = composed("+model=tiny-gpt2")
    hw = Hardware("cpu", 0, 0, 24 * GIB, 1, 2, fp16_ok=False, device_name="some CPU")
    key, env = C.baseline_key(cfg, hw), C.environment()
    for boot, used in ((C.boot_id(), True), ("an earlier boot", False)):
        (tmp_path / C.CACHE_NAME).write_text(json.dumps({key: {"baseline_bytes": 123 << 20, "environment": env,
                                                                "boot": boot}}))
        cal = C.calibration_for(cfg, hw)
        assert cal.process_measured is used and (cal.cpu_process_bytes == 123 << 20) is used
    (tmp_path / C.CACHE_NAME).write_text(json.dumps({key: {"baseline_bytes": 123 << 20, "environment": "torch=0",
                                                            "boot": C.boot_id()}}))
    assert not C.calibration_for(cfg, hw).process_measured


def test_a_measured_runtime_overhead_replaces_both_priors_for_its_kind_of_run_only(tmp_path, monkeypatch):
    """The CI machine's ranks held 25-48 MiB more than this machine's beyond their tensors, with the same software:
    the overhead a micro rank measured here is what the gate adds, for the kind of run it measured."""
    import json

    from zerorun import calibration as C
    from zerorun import process_probe as P
    from zerorun.config import make_plan, plan_world
    from zerorun.hardware import Hardware
    from zerorun.memory import estimate
    from zerorun.memory.priors import RUNTIME_TERM

    monkeypatch.setenv("ZERORUN_CACHE", str(tmp_path))
    hw = Hardware("cpu", 0, 0, 24 * GIB, 1, 2, fp16_ok=False, device_name="some CPU")
    z2, z0 = composed("+model=tiny-gpt2", "zero=stage2"), composed("+model=tiny-gpt2", "zero=stage0")
    assert P.overhead_key(z2, hw) != P.overhead_key(z0, hw)
    stamp = {"environment": C.environment(), "boot": C.boot_id()}
    (tmp_path / C.CACHE_NAME).write_text(json.dumps({P.overhead_key(z2, hw): {"overhead_bytes": 77 << 20, **stamp}}))

    cal = C.calibration_for(z2, hw)  # one calibration serves every config autofit or the table tries

    def overhead(cfg):
        return estimate(cfg, make_plan(cfg, plan_world(cfg, hw)), hw, cal=cal).components[RUNTIME_TERM]
    assert overhead(z2) == 77 << 20
    assert overhead(z0) == M.DEFAULT_CALIBRATION.cpu_overhead_bytes  # not measured for ZeRO-0: the prior
    (tmp_path / C.CACHE_NAME).write_text(json.dumps({P.overhead_key(z2, hw): {"overhead_bytes": 77 << 20,
                                                                             **stamp, "boot": "an earlier boot"}}))
    cal = C.calibration_for(z2, hw)
    assert overhead(z2) == 2 * M.DEFAULT_CALIBRATION.cpu_zero_overhead_bytes  # measured in another boot: the prior
    # the estimator counted more than the micro rank held (process_probe.measure): nothing measured, the prior
    (tmp_path / C.CACHE_NAME).write_text(json.dumps({P.overhead_key(z2, hw): {"overhead_bytes": None, **stamp}}))
    cal = C.calibration_for(z2, hw)
    assert overhead(z2) == 2 * M.DEFAULT_CALIBRATION.cpu_zero_overhead_bytes


def test_tcmallocs_caches_measured_for_a_kind_are_its_heap_retention(tmp_path, monkeypatch):
    """What tcmalloc's small-object caches held in the micro rank of a kind (a Qwen3 ZeRO-0 kind: 9.7 MiB, and a real
    rank of it 9.5-10 where the 32 MiB cap was counted) is that kind's heap-retention term; other kinds keep theirs."""
    import json

    from zerorun import calibration as C
    from zerorun import process_probe as P
    from zerorun.config import make_plan, plan_world
    from zerorun.hardware import Hardware
    from zerorun.memory import estimate

    monkeypatch.setenv("ZERORUN_CACHE", str(tmp_path))
    hw = Hardware("cpu", 0, 0, 24 * GIB, 1, 2, fp16_ok=False, device_name="some CPU")
    shape = ("+model=gpt2", "trainer.micro_batch_size=4", "data.seq_len=256", "zero=stage2")
    tc, other, glibc = (composed(*shape, "launcher.allocator=tcmalloc"),
                        composed(*shape, "launcher.allocator=tcmalloc", "optimizer=sgd"),
                        composed(*shape, "launcher.allocator=glibc"))
    stamp = {"environment": C.environment(), "boot": C.boot_id()}
    (tmp_path / C.CACHE_NAME).write_text(json.dumps(
        {P.overhead_key(tc, hw): {"overhead_bytes": 60 << 20, "allocator_cache_bytes": 9 << 20, **stamp},
         P.overhead_key(glibc, hw): {"overhead_bytes": 60 << 20, "allocator_cache_bytes": 0, **stamp}}))
    cal = C.calibration_for(tc, hw)

    def retention(cfg):
        return estimate(cfg, make_plan(cfg, plan_world(cfg, hw)), hw, cal=cal).components["heap retention"]
    assert retention(tc) == 9 << 20
    # not measured for SGD: the prior, 2 × the small activations' churn up to the cap (glibc's arena: uncapped)
    assert retention(other) == min(retention(glibc), M.DEFAULT_CALIBRATION.tcmalloc_thread_caches) != 9 << 20


@settings(max_examples=25, deadline=None)
@given(model=st.sampled_from(["tiny-gpt2", "tiny-bert", "gpt2", "minilm", "tiny-llama", "qwen2.5-7b", "mistral-7b"]),
       stage=st.integers(0, 3), dtype=st.sampled_from(["fp32", "bf16"]), ckpt=st.booleans(),
       offload=st.sampled_from(["none", "cpu", "nvme"]), optimizer=st.sampled_from(["adamw", "adamw8bit", "sgd"]))
def test_the_micro_rank_runs_the_same_kind_of_run_on_a_micro_model(model, stage, dtype, ckpt, offload, optimizer):
    """The probe measures the code paths of the user's run (its key), on a model of a few hundred KiB."""
    from zerorun import process_probe as P
    from zerorun.config import check, plan_world
    from zerorun.hardware import Hardware
    from zerorun.memory import count_params

    hw = Hardware("cpu", 0, 0, 24 * GIB, 1, 2, fp16_ok=False, device_name="some CPU")
    cfg = composed(f"+model={model}", f"zero=stage{stage}", f"precision={dtype}", f"offload={offload}",
                   f"trainer.activation_checkpointing={str(ckpt).lower()}", f"optimizer={optimizer}")
    ok = dict(libaio=True, writable=lambda path: None)
    assume(not check(cfg, plan_world(cfg, hw), **ok))  # a combination the launcher refuses is not a run to probe
    micro = P.micro_config(cfg)
    same = lambda c: [p for p in P.overhead_key(c, hw).split("|") if not p.startswith("threads")]  # noqa: E731
    assert same(micro) == same(cfg)
    assert count_params(micro.model) < 500_000 and micro.launcher.nproc_per_node == 1
    assert not micro.model.pretrained and micro.data.seq_len <= micro.model.max_positions
    assert check(micro, plan_world(micro, hw), **ok) == []  # a config the launcher accepts


@pytest.mark.heavy
@pytest.mark.parametrize("model", ["qwen3-8b", "gemma-2-9b", "gemma-3-1b", "phi-3-mini", "mixtral-8x7b",
                                   "qwen3-30b-a3b", "modernbert-base", "deberta-v3-base"])
def test_a_traced_models_micro_rank_is_micro(model):
    """A traced model is built from its config.json fields: the micro rank shrinks those (before, it built two layers
    of the real widths and vocabulary: 1.6 G parameters for qwen3-8b), keeping the model type, grouped key/value
    heads and a token id inside the vocabulary."""
    from zerorun import process_probe as P
    from zerorun.arch import hf_fields
    from zerorun.memory import count_params

    cfg = composed(f"+model={model}")
    micro = P.micro_config(cfg)
    fields = hf_fields(micro.model)
    assert count_params(micro.model) < 3_500_000  # qwen3-30b-a3b keeps its 128 experts: 3.3 M
    assert micro.model.model_type == cfg.model.model_type and micro.model.num_layers == 2
    assert fields["vocab_size"] == P.MICRO["vocab_size"] == micro.model.vocab_size
    assert all(i < fields["vocab_size"] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
               for i in ([fields.get(k)] if not isinstance(fields.get(k), list) else fields[k]) if i is not None)
    grouped = lambda m: (m.num_kv_heads or m.num_heads) < m.num_heads  # noqa: E731
    assert grouped(micro.model) == grouped(cfg.model)


def test_a_micro_model_the_trace_refuses_keeps_the_real_fields_rather_than_failing_the_launch(monkeypatch):
    from zerorun import process_probe as P
    from zerorun.arch import hf_fields
    from zerorun.arch.config_json import ArchitectureError

    def refuse(*args):
        raise ArchitectureError("a width of no standard name")
    monkeypatch.setattr(P, "traced_fields", refuse)
    cfg = composed("+model=gemma-3-1b")
    micro = P.micro_config(cfg)  # before the gate: no exception reaches the user
    assert hf_fields(micro.model) == hf_fields(cfg.model) and micro.model.num_layers == 2

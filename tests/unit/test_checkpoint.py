"""Checkpoint discovery and where trainer.resume looks (no engine: the protocol's files only)."""
from pathlib import Path

import pytest

from helpers import composed
from zerorun import checkpoint
from zerorun.resume import candidates as resume_candidates


def make_tag(root: Path, step: int, complete: bool = True) -> None:
    d = root / checkpoint.tag_for(step)
    d.mkdir(parents=True)
    if complete:
        (d / checkpoint.COMPLETE).write_text(f'{{"step": {step}}}')  # a marker as zerorun writes it


def test_complete_tags_are_sorted_by_step_and_incomplete_ones_ignored(tmp_path):
    for step, ok in ((10, True), (2, True), (30, False), (9, True)):
        make_tag(tmp_path, step, ok)
    (tmp_path / "global_stepX").mkdir()  # not ours
    assert checkpoint.complete_tags(tmp_path) == ["global_step2", "global_step9", "global_step10"]
    assert checkpoint.complete_tags(tmp_path / "missing") == []


def test_latest_tag_follows_the_pointer_only_when_it_names_a_complete_tag(tmp_path):
    make_tag(tmp_path, 4)
    make_tag(tmp_path, 8)
    make_tag(tmp_path, 12, complete=False)
    assert checkpoint.latest_tag(tmp_path) == "global_step8"  # no pointer: newest complete
    (tmp_path / checkpoint.LATEST).write_text("global_step4")
    assert checkpoint.latest_tag(tmp_path) == "global_step4"
    (tmp_path / checkpoint.LATEST).write_text("global_step12")  # written before the crash finished the tag
    assert checkpoint.latest_tag(tmp_path) == "global_step8"


def test_resume_point_takes_the_first_candidate_with_a_complete_tag(tmp_path):
    empty, older = tmp_path / "empty", tmp_path / "older"
    empty.mkdir()
    make_tag(older / "checkpoints", 6)
    assert checkpoint.resume_point([empty, older]) == ((older / "checkpoints", "global_step6"), [])
    assert checkpoint.resume_point([older / "checkpoints"]) == ((older / "checkpoints", "global_step6"), [])
    assert checkpoint.resume_point([empty]) == (None, [])


@pytest.mark.heavy
def test_resume_candidates_this_run_then_siblings_newest_first(tmp_path):
    exp = tmp_path / "outputs" / "tiny-gpt2"
    for name in ("2026-01-01_10-00-00", "2026-01-02_10-00-00", "2026-01-03_10-00-00"):
        (exp / name).mkdir(parents=True)
    this = exp / "2026-01-02_10-00-00"
    assert resume_candidates(composed(), this) == [this, exp / "2026-01-03_10-00-00", exp / "2026-01-01_10-00-00"]
    explicit = composed(f"trainer.resume_from={tmp_path / 'x'}")
    assert resume_candidates(explicit, this) == [tmp_path / "x"]


def test_one_checkpoint_is_counted_as_the_disk_holds_it_and_a_small_disk_is_refused_with_both_figures(tmp_path):
    from helpers import CPU2, planned

    from zerorun.memory import checkpoint_bytes, export_bytes

    cfg, plan = planned("zero=stage2", "data.seq_len=64", world=CPU2)
    # tiny GPT-2 ZeRO-2 fp32 on 2 ranks wrote 15,315,195 bytes per tag (954,000 parameters: 4 + 4 + 8 per
    # parameter, plus small headers) in the e2e runs
    params = 954_000
    assert checkpoint_bytes(cfg, plan, params) == 16 * params
    assert export_bytes(cfg, params) == 4 * params
    need, export = checkpoint_bytes(cfg, plan, params), export_bytes(cfg, params)
    plenty = checkpoint.space_problem(tmp_path / "ckpt", need, tmp_path / "export", export, lambda p: 10 * need)
    assert plenty is None
    short = checkpoint.space_problem(tmp_path / "ckpt", need, tmp_path / "export", export, lambda p: need)
    assert short.startswith(f"{tmp_path / 'ckpt'}: 0.01 GiB free, 0.02 GiB needed for one checkpoint and the export")
    assert "trainer.checkpoint_dir" in short


@pytest.mark.heavy
def test_identity_names_what_differs_and_passes_the_same_model():
    gpt2, bert = checkpoint.identity(composed()), checkpoint.identity(composed("+model=tiny-bert"))
    assert checkpoint.identity_mismatch(gpt2, checkpoint.identity(composed("trainer.lr=1e-3", "model.dropout=0"))) is None
    why = checkpoint.identity_mismatch(bert, gpt2)
    assert "tiny-bert" in why and "tiny-gpt2" in why and "architecture" in why and "task" in why
    deeper = checkpoint.identity_mismatch(checkpoint.identity(composed("model.num_layers=4")), gpt2)
    assert "model.num_layers 4 vs 2" in deeper and "task" not in deeper
    lora = checkpoint.identity(composed("adapter=lora", "zero=stage2"))
    assert "adapter" in checkpoint.identity_mismatch(lora, gpt2)
    assert checkpoint.identity_mismatch({}, gpt2) is None  # a checkpoint of an older zerorun: nothing recorded


@pytest.mark.heavy
def test_a_checkpoint_of_another_model_is_refused_from_its_marker_or_its_run_dirs_config(tmp_path):
    import json

    import pytest
    from omegaconf import OmegaConf

    from zerorun.config import UserError
    from zerorun.resume import refuse_another_model

    cfg, bert = composed("trainer.resume=true"), composed("+model=tiny-bert")
    marked = tmp_path / "elsewhere"
    make_tag(marked, 2)
    (marked / "global_step2" / checkpoint.COMPLETE).write_text(json.dumps({"step": 2, "run": checkpoint.identity(bert)}))
    with pytest.raises(UserError, match="trainer.resume: .* another model.*tiny-bert"):
        refuse_another_model(cfg, marked, "global_step2", marked)
    run = tmp_path / "bert_run"
    make_tag(run / "checkpoints", 2)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(bert)))
    with pytest.raises(UserError, match=r"\+model=tiny-bert"):
        refuse_another_model(cfg, run / "checkpoints", "global_step2", run)
    refuse_another_model(bert, run / "checkpoints", "global_step2", run)  # its own model resumes


def _simulated_tags(max_steps, save_every, keep_last, start=0, existing=0):
    """The trainer's schedule (train/trainer.py: every save_every steps and at the last) with checkpoint.save's
    retention, step by step from ``start`` with ``existing`` tags: (most tags at once, tags left at the end)."""
    tags, most = [-1] * existing, existing
    for step in range(start + 1, max_steps + 1):
        if (save_every and step % save_every == 0) or step == max_steps:
            tags.append(step)
            most = max(most, len(tags))  # COMPLETE written, the oldest not yet deleted
            tags = tags[-keep_last:]
    return most, len(tags)


def test_tags_held_is_what_the_save_schedule_and_retention_leave():
    from hypothesis import given, strategies as st

    @given(st.integers(1, 300), st.integers(0, 40), st.integers(1, 6), st.integers(0, 300), st.integers(0, 4))
    def check(max_steps, save_every, keep_last, start, existing):
        assert checkpoint.tags_held(max_steps, save_every, keep_last) == _simulated_tags(max_steps, save_every,
                                                                                         keep_last)
        resumed = (max_steps, save_every, keep_last, min(start, max_steps), min(existing, keep_last))
        assert checkpoint.tags_held(*resumed) == _simulated_tags(*resumed)

    check()


def test_the_preflight_counts_every_checkpoint_the_run_keeps(tmp_path):
    need, export = 10 * 2**20, 3 * 2**20
    # the case: save_every=2 max_steps=4 keep_last=2 holds 2 checkpoints, 3 while the second completes
    tags = checkpoint.tags_held(4, 2, 2)
    assert tags == (2, 2)
    held = checkpoint.space_problem(tmp_path / "c", need, tmp_path / "e", export, lambda p: 16 * 2**20, tags)
    assert "2 checkpoints (trainer.keep_last=2) and the export" in held and "0.02 GiB needed" in held
    assert "a smaller trainer.keep_last" in held
    assert checkpoint.space_problem(tmp_path / "c", need, tmp_path / "e", export, lambda p: 16 * 2**20) is None
    many = checkpoint.space_problem(tmp_path / "c", need, tmp_path / "e", 0, lambda p: 25 * 2**20,
                                    checkpoint.tags_held(10, 2, 2))
    assert "3 checkpoints (trainer.keep_last=2, and one more while a save completes)" in many

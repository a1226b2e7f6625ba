"""adapter=qlora on 2 CPU ranks under ZeRO-2 (issue 35): a tiny Llama from a model file, its base in 4-bit NF4
(bitsandbytes' CPU kernels), LoRA on top. The loss falls, a rank killed mid-run is restarted from the last
checkpoint and the run continues bit-identically, the checkpoint holds the adapter (not the base), the export
writes an adapter peft loads onto the base, and each rank's peak RSS stays under the gate's bound."""
import json

import pytest

from helpers import TORCHRUN, run_killed_and_restarted, run_zerorun

pytestmark = pytest.mark.e2e


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_qlora_trains_resumes_bit_identically_and_exports_its_adapter(tmp_path, cache_dir):
    pytest.importorskip("bitsandbytes")
    base = ["+model=tiny-llama", "adapter=qlora", "adapter.r=8", "zero=stage2", "precision=bf16",
            "adapter.target_modules=[q_proj,k_proj,v_proj,o_proj]", "data.seq_len=64", "trainer.micro_batch_size=2",
            "trainer.lr=1e-2", "trainer.save_every=4", "trainer.lr_schedule=constant", "trainer.warmup_steps=0",
            "trainer.eval_every=0", "data.synthetic_docs=400", "launcher.nproc_per_node=2", TORCHRUN]
    full = run_zerorun([*base, "trainer.max_steps=8"], tmp_path / "full", cache_dir)
    assert full.returncode == 0, full.stdout[-3000:]
    seen = losses(tmp_path / "full")
    assert sum(seen[s] for s in (6, 7, 8)) < sum(seen[s] for s in (1, 2, 3)), seen
    est = json.loads((tmp_path / "full" / "estimate.json").read_text())
    peaks = [r["peak_rss_bytes"] for r in json.loads((tmp_path / "full" / "summary.json").read_text())["peak_memory"]]
    assert max(peaks) <= est["per_rank_bound_bytes"], (peaks, est["per_rank_bound_bytes"])
    adapter = tmp_path / "full" / "export" / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8
    tag = tmp_path / "full" / "checkpoints" / "global_step8"
    assert sum(f.stat().st_size for f in tag.rglob("*") if f.is_file()) < 2_000_000  # the adapter, not the base

    # Rank 1 killed after step 5: zerorun restarts the ranks from the step-4 checkpoint (the adapter and its
    # optimizer state on the 4-bit base), and steps 5-8 are the uninterrupted run's, bit for bit.
    resumed = run_killed_and_restarted([*base, "trainer.max_steps=8", "trainer.export=false"], tmp_path / "resumed",
                                       cache_dir, rank=1, step=5)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stdout[-3000:]
    assert json.loads((tmp_path / "resumed" / "summary.json").read_text())["resumed_from_step"] == 4
    again = losses(tmp_path / "resumed")
    assert sorted(again) == list(range(1, 9)) and all(again[s] == seen[s] for s in again), (again, seen)

    # The adapter loads onto the base it trained on (random init from the same seed: the run's own base).
    import torch
    from peft import PeftModel

    from zerorun.config import compose
    from zerorun.models import build_model

    cfg = compose(["+model=tiny-llama"])
    torch.manual_seed(cfg.seed)
    model = PeftModel.from_pretrained(build_model(cfg.model), str(adapter))
    assert any("lora_A" in n for n, _ in model.named_parameters())

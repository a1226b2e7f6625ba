"""The data behind the pictures: estimate terms sorted into the stacked bar's categories without losing a byte."""
from helpers import CPU2, composed
from zerorun import report
from zerorun.config import make_plan
from zerorun.memory import estimate


def test_every_estimate_term_lands_in_a_category_and_the_peak_bar_is_the_estimate():
    cfg = composed("+model=gpt2", "zero=stage2", "offload=cpu", "precision=bf16")
    e = estimate(cfg, make_plan(cfg, CPU2), __import__("helpers").CPU_HOST).to_json()
    data = report.memory_data(e, {"peak_memory": [{"peak_rss_bytes": 5}, {"peak_rss_bytes": 7}]})
    assert data["measured"] == [5, 7]
    assert sum(data["bars"][e["peak_phase"]].values()) == e["per_rank_peak_bytes"]
    for phase, entries in e["phases"].items():
        named = {report.category(k) for k in entries}
        assert "other" not in named, (phase, [k for k in entries if report.category(k) == "other"])
    assert report.category("fp32 master copies") == "optimizer states"
    assert report.category("optimizer-step transient") == "buffers + transients"

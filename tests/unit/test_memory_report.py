"""train/memory_report.gather_memory: every rank's figures in one all-gather, on the rank's device (NCCL gathers
CUDA tensors only: a CPU tensor failed every GPU run at its end with "No backend type associated with device type
cpu", found on an H100)."""
from types import SimpleNamespace

import torch

from zerorun.train import memory_report


class RecordingDist:
    """all_gather that checks where its tensors live, then hands back host copies (one per rank)."""

    def __init__(self, device):
        self.device, self.calls = torch.device(device), []

    def all_gather(self, out, tensor):
        self.calls.append((tensor.device, [t.device for t in out]))
        assert tensor.device == self.device and all(t.device == self.device for t in out)
        for r in range(len(out)):
            out[r] = torch.full(tensor.shape, float(1000 + r), dtype=tensor.dtype)


def test_gather_runs_on_the_ranks_device(monkeypatch):
    states = {"parameters": 1, "persistent parameters": 2, "fp32 master copies": 3, "optimizer states": 4}
    monkeypatch.setattr(memory_report, "model_state_bytes", lambda engine: states)
    dist = RecordingDist("meta")  # any device but the host's: where a GPU rank's tensors live
    trainer = SimpleNamespace(engine=None, strategy=SimpleNamespace(pipeline=False), world=2, device="meta",
                              rss=SimpleNamespace(points={}), dist=dist, heap_limit={})
    rows = memory_report.gather_memory(trainer, live=None)
    assert len(dist.calls) == 1
    assert [r["rank"] for r in rows] == [0, 1]
    assert [r["peak_rss_bytes"] for r in rows] == [1000, 1001]
    assert [r["allocator_cache_bytes"] for r in rows] == [1000, 1001]  # each field read from its own slot

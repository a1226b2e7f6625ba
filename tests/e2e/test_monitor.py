"""monitor=tensorboard|csv: DeepSpeed's own monitors write into the run dir, and TensorBoard's own reader loads
the loss series zerorun's metrics.jsonl has."""
import csv

import pytest

from helpers import read_metrics, run_zerorun

pytestmark = pytest.mark.e2e
QUICK = ["launcher.nproc_per_node=2", "trainer.max_steps=4", "trainer.micro_batch_size=2", "data.seq_len=64",
         "trainer.progress=false", "trainer.export=false", "trainer.eval_every=2"]


def test_tensorboard_events_hold_the_loss_series(tmp_path, cache_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "tb"
    proc = run_zerorun([*QUICK, "monitor=tensorboard"], run, cache_dir)
    assert proc.returncode == 0, proc.stdout[-3000:]
    logdirs = {p.parent for p in (run / "monitor").rglob("events.out.tfevents.*")}
    assert len(logdirs) == 1, logdirs
    acc = EventAccumulator(str(logdirs.pop()))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/val_loss"} <= set(tags), tags
    losses = [e.value for e in acc.Scalars("Train/Samples/train_loss")]
    want = [m["loss"] for m in read_metrics(run)]
    assert losses == pytest.approx(want, rel=1e-6)  # float32 in the event file
    assert len(acc.Scalars("Train/Samples/val_loss")) == 1  # step 2 (the final evaluation is in summary.json)


def test_csv_monitor_writes_the_loss_series(tmp_path, cache_dir):
    run = tmp_path / "csv"
    proc = run_zerorun([*QUICK, "monitor=csv", "trainer.eval_every=0"], run, cache_dir)
    assert proc.returncode == 0, proc.stdout[-3000:]
    files = list((run / "monitor").rglob("*train_loss*.csv"))
    assert len(files) == 1, list((run / "monitor").rglob("*"))
    rows = list(csv.reader(files[0].open()))
    values = [float(r[1]) for r in rows[1:]]
    assert values == pytest.approx([m["loss"] for m in read_metrics(run)], rel=1e-9)

"""zerorun as SageMaker and Slurm start it, on two hosts of one machine (tests/netns.py) that resolve each
other by the platform's host names: nothing around zerorun but what the platform itself provides."""
import json
import os
import signal
import subprocess
import time

import pytest

import netns
from helpers import BIN, base_env, read_metrics, start_on_host

WHY = netns.unavailable()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(WHY is not None, reason=f"no test hosts: {WHY}")]

HPS = {"launcher.nproc_per_node": 2, "trainer.micro_batch_size": 2, "data.seq_len": 64, "trainer.warmup_steps": 1,
       "trainer.lr": 2e-3, "trainer.progress": False, "zero": "stage2", "trainer.global_batch_size": 8}
TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog while zerorun trains a model.\n"
               for i in range(600))


@pytest.fixture(scope="module")
def hosts():
    with netns.hosts(2, names=["algo-1 node07", "algo-2 node08"]) as hs:
        yield hs


def sagemaker_instance(root, i, hosts, hps):
    """/opt/ml of instance algo-{i+1}, as the platform lays it out: config, one channel, a checkpoint dir."""
    base = root / f"ml{i}"
    (base / "input" / "config").mkdir(parents=True, exist_ok=True)
    (base / "input" / "config" / "resourceconfig.json").write_text(json.dumps(
        {"current_host": f"algo-{i + 1}", "hosts": ["algo-1", "algo-2"], "network_interface_name": hosts[i].ifname}))
    # The SDK stores every value JSON-encoded, as strings.
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps(
        {**{k: json.dumps(v) for k, v in hps.items()}, "sagemaker_program": json.dumps("zerorun")}))
    (base / "input" / "data" / "train").mkdir(parents=True, exist_ok=True)
    (base / "input" / "data" / "train" / "corpus.txt").write_text(TEXT)
    (base / "checkpoints").mkdir(exist_ok=True)
    return base


def both(procs, timeout=600):
    deadline = time.time() + timeout
    outs = [p.communicate(timeout=max(1, deadline - time.time()))[0] for p in procs]
    return [p.returncode for p in procs], outs


def test_sagemaker_two_instances_a_failure_then_the_restarted_job_resumes(hosts, tmp_path):
    bases = [sagemaker_instance(tmp_path, i, hosts, {**HPS, "trainer.save_every": 2}) for i in range(2)]
    # The toolkit runs the entry point with the hyperparameters as `--key value` pairs too.
    argv = ["--trainer.max_steps", "6"]

    def start(i, extra=None):
        return start_on_host(hosts[i], argv, bases[i], tmp_path / f"cache{i}",
                             {"SAGEMAKER_BASE_DIR": str(bases[i]), **(extra or {})})

    # First start: a rank of algo-2 dies after step 5 (as an instance fault would kill it).
    codes, outs = both([start(0), start(1, {"ZERORUN_FAULT_KILL": "3:5"})])
    assert codes[0] != 0 and codes[1] != 0, "\n=====\n".join(o[-2500:] for o in outs)
    for i, b in enumerate(bases):
        assert "SageMaker: host algo-%d (%d of 2)" % (i + 1, i + 1) in outs[i]
        failure = (b / "output" / "failure").read_text()
        assert failure.startswith("zerorun exited 1: ") and "rerun it on every node" in failure, failure
        assert (b / "checkpoints" / f"node{i}" / "global_step4" / "COMPLETE").is_file()
        assert not (b / "model" / "model.safetensors").exists()
    # SageMaker restarts the job: a fresh container (output/ gone), checkpoints copied back from S3.
    for b in bases:
        subprocess.run(["rm", "-rf", str(b / "output")], check=True)
    codes, outs = both([start(0), start(1)])
    assert codes == [0, 0], "\n=====\n".join(o[-2500:] for o in outs)
    for i, b in enumerate(bases):
        assert "resuming from" in outs[i] and not (b / "output" / "failure").exists()
        run = b / "output" / "data" / "run"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["resumed_from_step"] == 4 and summary["world_size"] == 4 and summary["steps"] == 6
        assert [m["step"] for m in read_metrics(run)] == [5, 6]  # steps 1-5 went with the first container
        # the model lands in the model dir of the master only
        assert (b / "model" / "model.safetensors").is_file() == (i == 0)
        assert not (run / "export").exists()


def test_bad_sagemaker_input_fails_with_one_line_and_the_failure_file(tmp_path):
    base = sagemaker_instance(tmp_path, 0, [netns.Host("x", "127.0.0.1", "lo")] * 2, {"zero": "stage2"})
    (base / "input" / "config" / "resourceconfig.json").write_text(json.dumps(
        {"current_host": "algo-3", "hosts": ["algo-1", "algo-2"]}))
    proc = subprocess.run([str(BIN / "zerorun")], env={**base_env(tmp_path / "cache"),
                                                       "SAGEMAKER_BASE_DIR": str(base)},
                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout
    assert "the current host 'algo-3' is not in the host list ['algo-1', 'algo-2']" in proc.stdout
    assert "nothing was launched" in proc.stdout
    assert (base / "output" / "failure").read_text().startswith("SageMaker: the current host 'algo-3'")
    assert not (base / "output" / "data").exists()


def test_slurm_two_nodes_usr2_checkpoints_requeues_and_the_requeued_job_resumes(hosts, tmp_path):
    stub = tmp_path / "bin"
    stub.mkdir()
    calls = tmp_path / "scontrol.calls"
    (stub / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (stub / "scontrol").chmod(0o755)
    args = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in HPS.items()] + ["trainer.max_steps=40"]

    def srun_task(i, restart=0):
        """What `srun --ntasks-per-node=1 zerorun ...` gives the task on node i."""
        env = {"SLURM_JOB_ID": "777", "SLURM_JOB_NAME": "ft", "SLURM_STEP_ID": "0", "SLURM_NODEID": str(i),
               "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
               "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": str(restart),
               "PATH": f"{stub}:{os.environ['PATH']}"}
        return start_on_host(hosts[i], args, tmp_path, tmp_path / f"cache{i}", env)

    run = tmp_path / "zerorun-runs" / "ft-777-0"
    procs = [srun_task(0), srun_task(1)]
    deadline = time.time() + 400
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if (run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 3:
            break
        time.sleep(0.5)
    ended = [p for p in procs if p.poll() is not None]  # a task that is gone cannot be signalled: say why it went
    assert not ended, "\n=====\n".join(f"exit {p.returncode}:\n{p.communicate()[0][-2500:]}" for p in ended)
    for p in procs:  # `#SBATCH --signal=USR2@120`: Slurm signals every task of the job
        os.kill(p.pid, signal.SIGUSR2)
    codes, outs = both(procs)
    assert codes == [75, 75], "\n=====\n".join(o[-2500:] for o in outs)
    assert calls.read_text().split("\n")[0] == "requeue 777"  # node 0 requeues, once
    assert "requeueing the job" in outs[0] and "requeueing" not in outs[1]
    stopped = max(m["step"] for m in read_metrics(run))
    codes, outs = both([srun_task(0, restart=1), srun_task(1, restart=1)])
    assert codes == [0, 0], "\n=====\n".join(o[-2500:] for o in outs)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped and summary["world_size"] == 4
    got = read_metrics(run)
    assert [m["step"] for m in got] == list(range(1, 41)) and got[-1]["loss"] < got[0]["loss"]

"""Two hosts on one machine (network namespaces, tests/netns.py), 2 CPU ranks each, zerorun started on each
host exactly as a user starts it on a node. Losses match the same job on one host with 4 ranks."""
import json
import subprocess
import time

import pytest

import netns
from helpers import read_metrics, run_zerorun, start_on_host

WHY = netns.unavailable()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(WHY is not None, reason=f"no test hosts: {WHY}")]

JOB = ["launcher.nproc_per_node=2", "trainer.max_steps=6", "trainer.micro_batch_size=2", "data.seq_len=64",
       "trainer.warmup_steps=1", "trainer.lr=2e-3", "trainer.progress=false", "trainer.export=false",
       "zero=stage2", "trainer.global_batch_size=8"]
PORT = 29611


@pytest.fixture(scope="module")
def hosts():
    with netns.hosts(2) as hs:
        yield hs


@pytest.fixture(scope="module")
def one_host_reference(tmp_path_factory, cache_dir):
    run = tmp_path_factory.mktemp("multinode") / "one-host"
    proc = run_zerorun([*[a for a in JOB if not a.startswith("launcher.nproc")], "launcher.nproc_per_node=4"],
                       run, cache_dir)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return {m["step"]: m for m in read_metrics(run)}


def start_on(host, node_rank, args, run_dir, cache, env_extra=None):
    """zerorun on one host, as a user runs it there (its own data cache: nothing shared but the run dir)."""
    return start_on_host(host, [*args, f"launcher.node_rank={node_rank}", f"hydra.run.dir={run_dir}"], run_dir.parent,
                         cache, env_extra)


def run_on_both(hosts, args, run_dirs, tmp_path, timeout=600, env_extra=None):
    procs = [start_on(h, i, args, run_dirs[i], tmp_path / f"cache{i}", (env_extra or {}).get(i))
             for i, h in enumerate(hosts)]
    outs = []
    deadline = time.time() + timeout
    for p in procs:
        outs.append(p.communicate(timeout=max(1, deadline - time.time()))[0])
    return [p.returncode for p in procs], outs


def multinode(hosts, launcher, port):
    return [*JOB, f"launcher={launcher}", "launcher.nnodes=2", f"launcher.master_addr={hosts[0].addr}",
            f"launcher.master_port={port}"]


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_two_hosts_shared_run_dir(hosts, tmp_path, one_host_reference, launcher):
    run = tmp_path / "run"
    run.mkdir()
    codes, outs = run_on_both(hosts, multinode(hosts, launcher, PORT + (launcher == "deepspeed")), [run, run],
                              tmp_path)
    assert codes == [0, 0], "\n=====\n".join(o[-2500:] for o in outs)
    got = read_metrics(run)
    assert [m["step"] for m in got] == list(range(1, 7))
    assert got[-1]["loss"] < got[0]["loss"]
    same_as_one_host(got, one_host_reference)


def same_as_one_host(got, reference):
    for m in got:  # the same job on 4 ranks of one host: same data, same math, another reduction order
        want = reference[m["step"]]
        assert m["data_fingerprint"] == want["data_fingerprint"]
        assert m["loss"] == pytest.approx(want["loss"], rel=1e-4), m["step"]


@pytest.mark.slow  # (test_platform_jobs.py restarts a failed two-node job and resumes it in `make test`)
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_run_dir_per_node_a_node_killed_and_the_job_resumed(hosts, tmp_path, one_host_reference, launcher):
    """No shared filesystem: each node's run dir on its own "disk". A rank of node 1 dies after step 5; both
    nodes stop; the same command with trainer.resume=true continues from each node's own step-4 checkpoint."""
    runs = [tmp_path / f"disk{i}" / "run" for i in range(2)]
    for r in runs:
        r.mkdir(parents=True)
    args = [*multinode(hosts, launcher, PORT + 6 + (launcher == "deepspeed")), "launcher.shared_run_dir=false",
            "trainer.save_every=2", "trainer.export=true", "trainer.collective_timeout_s=60"]
    t0 = time.time()
    codes, outs = run_on_both(hosts, args, runs, tmp_path, env_extra={1: {"ZERORUN_FAULT_KILL": "3:5"}})
    assert codes[0] != 0 and codes[1] != 0, "\n=====\n".join(o[-2500:] for o in outs)
    assert all("rerun it on every node with trainer.resume=true" in o for o in outs), outs[0][-2500:]
    print(f"both nodes stopped {time.time() - t0:.0f} s after the start")
    for node, r in enumerate(runs):  # node-local: each node holds its own ranks' shards, each tag complete
        tag = r / "checkpoints" / "global_step4"
        assert (tag / "COMPLETE").is_file() and (tag / "mp_rank_00_model_states.pt").is_file()
        shards = sorted(p.name.split("_")[3] for p in tag.glob("*optim_states.pt"))
        assert shards == [str(2 * node), str(2 * node + 1)], shards
    codes, outs = run_on_both(hosts, [*args, "trainer.resume=true"], runs, tmp_path)
    assert codes == [0, 0], "\n=====\n".join(o[-2500:] for o in outs)
    for node, r in enumerate(runs):  # each node's run dir is complete; only node 0 holds the export
        got = read_metrics(r)
        assert [m["step"] for m in got] == list(range(1, 7)), node
        same_as_one_host(got, one_host_reference)
        summary = json.loads((r / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["resumed_from_step"] == 4
        assert (r / "export" / "model.safetensors").is_file() == (node == 0)
        assert "resuming from" in outs[node]


def test_a_run_dir_said_to_be_shared_that_is_not_fails_at_the_preflight(hosts, tmp_path):
    runs = [tmp_path / f"disk{i}" / "run" for i in range(2)]
    for r in runs:
        r.mkdir(parents=True)
    t0 = time.time()
    codes, outs = run_on_both(hosts, multinode(hosts, "torchrun", PORT + 8), runs, tmp_path, timeout=300)
    assert codes == [2, 2], "\n=====\n".join(o[-2500:] for o in outs)
    for out in outs:
        assert "does not see node 0's files in its run dir" in out and "launcher.shared_run_dir=false" in out, out[-2000:]
    assert time.time() - t0 < 60


def test_nodes_that_differ_fail_in_seconds_naming_the_node_and_the_difference(hosts, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    args = multinode(hosts, "torchrun", PORT + 2)
    # Host 1 has another DeepSpeed installed, as far as package metadata tells (what `pip list` reads).
    other = tmp_path / "other-site" / "deepspeed-0.18.0.dist-info"
    other.mkdir(parents=True)
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.18.0\n")
    procs = [start_on(hosts[0], 0, args, run, tmp_path / "cache0"),
             start_on(hosts[1], 1, [*args, "trainer.lr=1e-3"], run, tmp_path / "cache1",
                      {"PYTHONPATH": str(other.parent)})]
    t0 = time.time()
    outs = [p.communicate(timeout=300)[0] for p in procs]
    elapsed = time.time() - t0
    assert [p.returncode for p in procs] == [2, 2], "\n=====\n".join(o[-2500:] for o in outs)
    for out in outs:  # the same line on every node
        assert "the nodes differ: node 1 (" in out and "its config differs from node 0's" in out, out[-2500:]
        assert "deepspeed 0.18.0 (node 0: 0.19." in out, out[-2500:]
    assert elapsed < 60, elapsed  # before any model is built; startup included
    assert not (run / "metrics.jsonl").exists()


def test_a_wrong_master_address_or_a_taken_port_fails_at_once(hosts, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    wrong = hosts[1].addr.rsplit(".", 1)[0] + ".99"  # in the subnet, no such host
    t0 = time.time()
    proc = start_on(hosts[1], 1, [*JOB, "launcher=torchrun", "launcher.nnodes=2", f"launcher.master_addr={wrong}",
                                  f"launcher.master_port={PORT + 3}"], run, tmp_path / "cache1")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2 and f"launcher.master_addr={wrong} cannot be reached from this node" in out, out[-2000:]
    assert time.time() - t0 < 60
    taker = subprocess.Popen(hosts[0].argv(["python3", "-c", f"import socket,time; s=socket.socket(); "
                                            f"s.bind(('', {PORT + 4})); s.listen(); time.sleep(120)"]))
    try:
        time.sleep(1)
        proc = start_on(hosts[0], 0, [*JOB, "launcher=torchrun", "launcher.nnodes=2",
                                      f"launcher.master_addr={hosts[0].addr}", f"launcher.master_port={PORT + 4}"],
                        run, tmp_path / "cache0")
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 2 and f"launcher.master_port={PORT + 4} is already in use" in out, out[-2000:]
        assert "nothing was launched" in out
    finally:
        taker.kill()


@pytest.mark.slow
def test_c10d_rendezvous_nodes_start_in_any_order(hosts, tmp_path, one_host_reference):
    run = tmp_path / "run"
    run.mkdir()
    # No node ranks: torchrun's c10d rendezvous at host 0's address assigns them; host 1 starts first.
    args = [*JOB, "launcher=torchrun", "launcher.nnodes=2", "launcher.rdzv=c10d", "launcher.rdzv_id=job-c10d",
            "trainer.collective_timeout_s=90",
            f"launcher.master_addr={hosts[0].addr}", f"launcher.master_port={PORT + 5}"]
    late = start_on(hosts[1], 0, args, run, tmp_path / "cache1")
    time.sleep(5)
    early = start_on(hosts[0], 0, args, run, tmp_path / "cache0")
    outs = [p.communicate(timeout=400)[0] for p in (early, late)]
    assert [early.returncode, late.returncode] == [0, 0], "\n=====\n".join(o[-2500:] for o in outs)
    assert "waiting for node 0" in outs[1]
    got = read_metrics(run)
    assert [m["step"] for m in got] == list(range(1, 7))
    for m in got:
        assert m["data_fingerprint"] == one_host_reference[m["step"]]["data_fingerprint"]
        assert m["loss"] == pytest.approx(one_host_reference[m["step"]]["loss"], rel=1e-4), m["step"]

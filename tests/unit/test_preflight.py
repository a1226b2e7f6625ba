"""Multi-node preflight: what each node's launcher hands its ranks, and the one line per differing node."""
from zerorun.train import preflight


def facts(node, **over):
    base = {"node_rank": node, "host": f"h{node}", "versions": {"zerorun": "0.1", "torch": "2.13.0",
            "deepspeed": "0.19.8", "transformers": "4.57.6"}, "config": "c", "data": "d",
            "nproc_per_node": 2, "devices": 0, "resume": "none"}
    return {**base, **over}


def test_identical_nodes_agree_and_each_difference_is_named_once_per_node():
    assert preflight.differences([facts(0), facts(0), facts(1), facts(1)]) == []
    got = preflight.differences([facts(0), facts(1, config="x", data="y"), facts(1, config="x", data="y"),
                                 facts(2, versions={**facts(0)["versions"], "deepspeed": "0.18.0"}, devices=4)])
    assert got == ["node 1 (h1): its config differs from node 0's (x vs c); its tokenized data differs from "
                   "node 0's (y vs d)",
                   "node 2 (h2): deepspeed 0.18.0 (node 0: 0.19.8); devices 4 (node 0: 0)"]


def test_launcher_facts_ignore_only_the_node_rank(tmp_path):
    data = tmp_path / "train.npy"
    data.write_bytes(b"tokens")
    a = preflight.launcher_facts("launcher:\n  node_rank: 0\n  nnodes: 2\n", 0, [str(data)], 2, 0, "/run", True, "")
    b = preflight.launcher_facts("launcher:\n  node_rank: 1\n  nnodes: 2\n", 1, [str(data)], 2, 0, "/run", True, "")
    assert a["config"] == b["config"] and a["data"] == b["data"]
    c = preflight.launcher_facts("launcher:\n  node_rank: 1\n  nnodes: 3\n", 1, [str(data)], 2, 0, "/run", True, "")
    assert c["config"] != a["config"]
    data.write_bytes(b"other")
    assert preflight.launcher_facts("launcher:\n  node_rank: 0\n", 0, [str(data)], 2, 0, "/run", True, "")["data"] != a["data"]


def test_nodes_resuming_from_different_steps_are_named():
    got = preflight.differences([facts(0, resume="global_step6"), facts(1, resume="global_step4")])
    assert got == ["node 1 (h1): it resumes from global_step4 (node 0: global_step6): every node needs the same "
                   "checkpoint step (is one node's checkpoint damaged or missing?)"]


def node(n, shared, sees):
    return facts(n, id=f"h{n}-1", run_dir=f"/disk{n}/run", shared_run_dir=shared, sees=sees)


def test_a_run_dir_said_to_be_shared_that_is_not_is_refused_naming_the_blind_node():
    ok = [node(0, True, ["h0-1", "h1-1"]), node(0, True, ["h0-1", "h1-1"]), node(1, True, ["h0-1", "h1-1"])]
    assert preflight.differences(ok) == []
    got = preflight.differences([node(0, True, ["h0-1"]), node(1, True, ["h1-1"])])
    assert len(got) == 2 and got[1].startswith("node 1 (h1) does not see node 0's files in its run dir /disk1/run")
    assert "launcher.shared_run_dir=false" in got[0]


def test_node_local_run_dirs_that_are_one_directory_are_refused():
    assert preflight.differences([node(0, False, ["h0-1"]), node(1, False, ["h1-1"])]) == []
    got = preflight.differences([node(0, False, ["h0-1", "h1-1"]), node(1, False, ["h0-1", "h1-1"])])
    assert got[0].startswith("node 0 (h0) shares its run dir /disk0/run with node 1 but launcher.shared_run_dir=false")

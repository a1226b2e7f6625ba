"""Multi-node preflight: what each node's launcher hands its ranks, and the one line per differing node."""
from zerorun.train import preflight


def facts(node, **over):
    base = {"node_rank": node, "host": f"h{node}", "versions": {"zerorun": "0.1", "torch": "2.13.0",
            "deepspeed": "0.19.8", "transformers": "4.57.6"}, "config": "c", "data": "d",
            "nproc_per_node": 2, "devices": 0}
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
    a = preflight.launcher_facts("launcher:\n  node_rank: 0\n  nnodes: 2\n", 0, [str(data)], 2, 0)
    b = preflight.launcher_facts("launcher:\n  node_rank: 1\n  nnodes: 2\n", 1, [str(data)], 2, 0)
    assert a["config"] == b["config"] and a["data"] == b["data"]
    c = preflight.launcher_facts("launcher:\n  node_rank: 1\n  nnodes: 3\n", 1, [str(data)], 2, 0)
    assert c["config"] != a["config"]
    data.write_bytes(b"other")
    assert preflight.launcher_facts("launcher:\n  node_rank: 0\n", 0, [str(data)], 2, 0)["data"] != a["data"]

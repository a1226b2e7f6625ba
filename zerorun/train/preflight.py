"""Before anything expensive, the ranks of a multi-node job agree on what they run.

Each node's zerorun computes what its ranks must share (software versions, the config, the tokenized data,
devices) and hands it to them in the environment (``ZERORUN_PREFLIGHT``: node-specific, so a shared run dir
that another node overwrote cannot hide a difference). When the ranks first meet, one all-gather compares
every node with node 0; a difference is one line naming the node and what differs, on every node, exit 2:
seconds, not a 30-minute collective timeout later.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List

ENV = "ZERORUN_PREFLIGHT"
NODE_OWN = ("node_rank:", "path:", "val_path:", "checkpoint_dir:", "export_dir:", "nvme_path:", "resume_from:",
            "mmap_threshold_mib:")  # auto resolves from each node's own free memory
COMPARED = ("versions", "config", "data", "nproc_per_node", "devices", "resume")
NODES_DIR = "nodes"
"""In the run dir: one file per running zerorun (named by its id); which ones a node sees tells whether the
run dir is shared."""


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def launcher_id() -> str:
    """This zerorun process, in the run dir's nodes/ (its file is removed when it ends)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def launcher_facts(config_yaml: str, node_rank: int, data_files: List[str], nproc_per_node: int,
                   devices: int, run_dir: str, shared_run_dir: bool, resume_tag: str) -> Dict[str, Any]:
    """What this node's ranks must agree on with every other node (computed by the launcher)."""
    versions = {}
    for name in ("zerorun", "torch", "deepspeed", "transformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "-"
    # What may differ: the node's own rank, and paths on its own disk (their contents are compared: data hash).
    shared = "\n".join(line for line in config_yaml.splitlines() if not line.strip().startswith(NODE_OWN))
    data = hashlib.sha256("".join(_file_digest(p) for p in data_files if Path(p).is_file()).encode()).hexdigest()[:16]
    return {"node_rank": node_rank, "host": socket.gethostname(), "versions": versions,
            "config": hashlib.sha256(shared.encode()).hexdigest()[:16], "data": data,
            "nproc_per_node": nproc_per_node, "devices": devices, "resume": resume_tag or "none",
            "run_dir": run_dir, "id": launcher_id(), "shared_run_dir": shared_run_dir}


def differences(facts: List[Dict[str, Any]]) -> List[str]:
    """One line per node that differs from node 0, naming what differs."""
    ref = next((f for f in facts if f.get("node_rank") == 0), facts[0])
    out, seen = [], set()
    for f in facts:
        if f.get("node_rank") in seen or f is ref:
            continue
        seen.add(f.get("node_rank"))
        diffs = []
        for key in COMPARED:
            if f.get(key) == ref.get(key):
                continue
            if key == "versions":
                diffs += [f"{k} {f[key].get(k)} (node 0: {ref[key].get(k)})" for k in ref[key]
                          if f[key].get(k) != ref[key].get(k)]
            elif key == "resume":
                diffs.append(f"it resumes from {f[key]} (node 0: {ref[key]}): every node needs the same "
                             "checkpoint step (is one node's checkpoint damaged or missing?)")
            elif key in ("config", "data"):
                diffs.append(f"its {'config' if key == 'config' else 'tokenized data'} differs from node 0's "
                             f"({f[key]} vs {ref[key]})")
            else:
                diffs.append(f"{key} {f.get(key)} (node 0: {ref.get(key)})")
        if diffs:
            out.append(f"node {f.get('node_rank')} ({f.get('host')}): " + "; ".join(diffs))
    return out + run_dir_problems(facts)


def run_dir_problems(facts: List[Dict[str, Any]]) -> List[str]:
    """A run dir that is shared when the config says each node has its own, or the other way round: checkpoints
    only one node can read (the first resume fails), or two nodes writing the same files."""
    nodes = list({f.get("id"): f for f in facts if f.get("id")}.values())
    if len(nodes) < 2 or "sees" not in nodes[0]:
        return []
    out = []
    for f in nodes:
        others = [g for g in nodes if g is not f]
        if f.get("shared_run_dir"):
            blind = [g for g in others if g["id"] not in f["sees"]]
            if blind:
                out.append(f"node {f.get('node_rank')} ({f.get('host')}) does not see node "
                           f"{blind[0].get('node_rank')}'s files in its run dir {f.get('run_dir')}: the run dir is not "
                           "shared. Put hydra.run.dir on a filesystem every node mounts, or set "
                           "launcher.shared_run_dir=false (each node keeps its own checkpoints)")
        else:
            same = [g for g in others if g["id"] in f["sees"]]
            if same:
                out.append(f"node {f.get('node_rank')} ({f.get('host')}) shares its run dir {f.get('run_dir')} with "
                           f"node {same[0].get('node_rank')} but launcher.shared_run_dir=false: set "
                           "launcher.shared_run_dir=true, or give each node its own hydra.run.dir")
    return out


def check(dist, rank: int, run_dir: Path) -> List[str]:
    """All-gather every rank's facts (from its launcher) and return the differences (the same on every rank)."""
    mine = json.loads(os.environ.get(ENV, "{}"))
    if not mine:
        return []
    # Listed now, not by the launcher: every node's zerorun has written its file before its ranks got here.
    nodes = run_dir / NODES_DIR
    mine["sees"] = sorted(p.name for p in nodes.iterdir()) if nodes.is_dir() else []
    # With c10d rendezvous torchrun assigns the node rank (GROUP_RANK); the config's is a placeholder.
    mine["node_rank"] = int(os.environ.get("GROUP_RANK", mine["node_rank"]))
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return differences([g for g in gathered if g])

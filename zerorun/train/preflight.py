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
COMPARED = ("versions", "config", "data", "nproc_per_node", "devices")


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def launcher_facts(config_yaml: str, node_rank: int, data_files: List[str], nproc_per_node: int,
                   devices: int) -> Dict[str, Any]:
    """What this node's ranks must agree on with every other node (computed by the launcher)."""
    versions = {}
    for name in ("zerorun", "torch", "deepspeed", "transformers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "-"
    # The node's own rank is the one line that must differ.
    shared = "\n".join(line for line in config_yaml.splitlines() if not line.strip().startswith("node_rank:"))
    data = hashlib.sha256("".join(_file_digest(p) for p in data_files if Path(p).is_file()).encode()).hexdigest()[:16]
    return {"node_rank": node_rank, "host": socket.gethostname(), "versions": versions,
            "config": hashlib.sha256(shared.encode()).hexdigest()[:16], "data": data,
            "nproc_per_node": nproc_per_node, "devices": devices}


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
            elif key in ("config", "data"):
                diffs.append(f"its {'config' if key == 'config' else 'tokenized data'} differs from node 0's "
                             f"({f[key]} vs {ref[key]})")
            else:
                diffs.append(f"{key} {f.get(key)} (node 0: {ref.get(key)})")
        if diffs:
            out.append(f"node {f.get('node_rank')} ({f.get('host')}): " + "; ".join(diffs))
    return out


def check(dist, rank: int) -> List[str]:
    """All-gather every rank's facts (from its launcher) and return the differences (the same on every rank)."""
    mine = json.loads(os.environ.get(ENV, "{}"))
    if not mine:
        return []
    # With c10d rendezvous torchrun assigns the node rank (GROUP_RANK); the config's is a placeholder.
    mine["node_rank"] = int(os.environ.get("GROUP_RANK", mine["node_rank"]))
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return differences([g for g in gathered if g])

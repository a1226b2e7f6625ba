"""Several "hosts" on one machine for multi-node tests: Linux network namespaces joined by a bridge, each
with its own address. Traffic stays between the namespaces' own addresses; the tests create and remove
them. Needs root and iproute2 (CI has both); elsewhere the tests skip with the reason.

The namespaces share the filesystem (a shared run dir is simply the same path; "no shared filesystem" is
a different run dir per host) and /dev/shm, but not the network: each host reaches the others only over
its veth, as nodes do.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional

SUBNET = "10.213.{n}.{i}"


@dataclass(frozen=True)
class Host:
    name: str      # the namespace
    addr: str      # its address, as the other hosts see it
    ifname: str    # its interface (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)

    def argv(self, cmd: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def env(self) -> dict:
        # gloo binds the address its hostname resolves to unless told the interface; in a namespace that
        # is an address the namespace does not have.
        return {"GLOO_SOCKET_IFNAME": self.ifname, "NCCL_SOCKET_IFNAME": self.ifname}


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "iproute2's `ip` is not installed"
    probe = f"zrprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stdout.strip()}"
    subprocess.run(["ip", "netns", "del", probe])
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stdout.strip()}")


@contextmanager
def hosts(count: int = 2, names: Optional[List[str]] = None) -> Iterator[List[Host]]:
    """``count`` hosts on a bridge in a namespace of its own (so the machine's own network is untouched).
    ``names``: host names ("algo-1 node07" for two) every host resolves to the others' addresses, through
    the /etc/netns/<namespace>/hosts that ``ip netns exec`` puts over /etc/hosts."""
    tag = f"zr{os.getpid() % 10000}"
    net = os.getpid() % 200 + 20
    switch = f"{tag}sw"
    made: List[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        out = []
        for i in range(count):
            name, ifname, peer = f"{tag}h{i}", f"eth{i}", f"{tag}p{i}"
            _ip("netns", "add", name)
            made.append(name)
            _ip("link", "add", ifname, "netns", name, "type", "veth", "peer", "name", peer, "netns", switch)
            _ip("-n", switch, "link", "set", peer, "master", "br0")
            _ip("-n", switch, "link", "set", peer, "up")
            addr = SUBNET.format(n=net, i=i + 1)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", name, "link", "set", ifname, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            out.append(Host(name, addr, ifname))
        if names:
            table = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {n}\n" for h, n in zip(out, names))
            for h in out:
                os.makedirs(f"/etc/netns/{h.name}", exist_ok=True)
                with open(f"/etc/netns/{h.name}/hosts", "w") as f:
                    f.write(table)
        yield out
    finally:
        for name in made:
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

"""Multi-node: the mistakes that otherwise cost a 10-30 minute rendezvous timeout, caught in seconds before
any rank starts. Node 0: the master port must be free here. Other nodes: the master address must be a host
this node can reach (no such host or no route: at once); while nothing listens there yet (node 0 not
started), wait up to ``launcher.join_timeout_s``.
"""
from __future__ import annotations

import errno
import socket
import time
from typing import Optional

from .config.errors import UserError

UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL}


def is_local(addr: str) -> bool:
    """Whether ``addr`` is one of this host's addresses (it can be bound here): this node hosts the rendezvous."""
    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


def route_addr(addr: str) -> str:
    """This host's address on the route to ``addr`` (what the other nodes reach it by); "" if unknown."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(addr), 9))  # UDP: picks the route, sends nothing
            local = s.getsockname()[0]
    except OSError:
        return ""
    return "" if local.startswith("127.") else local  # loopback would be advertised to the other nodes


def port_problem(port: int) -> Optional[UserError]:
    """Node 0 serves the rendezvous on ``port``: taken by another process, every node would wait."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT from the last run is no conflict
        try:
            s.bind(("", port))
        except OSError as e:
            return UserError(f"launcher.master_port={port} is already in use on this node (node 0): {e.strerror}.",
                             "launcher.master_port=<a free port>, the same on every node.", key="launcher.master_port",
                             value=port)
    return None


def master_problem(addr: str, port: int, wait_s: float, log=print, listener: bool = True) -> Optional[UserError]:
    """From a node other than 0: can node 0's rendezvous be reached? Unknown names and unreachable hosts fail
    at once; a refused connection means node 0 has not started yet, so it is retried until ``wait_s``
    (``listener=False``, a dry run: only whether the host is there)."""
    key = "launcher.master_addr"
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return UserError(f"launcher.master_addr={addr} does not resolve on this node: {e.strerror}.",
                         "launcher.master_addr=<node 0's hostname or IP as this node sees it>.", key=key, value=addr)
    deadline, said = time.monotonic() + wait_s, False
    while True:
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.settimeout(5)
            try:
                s.connect(sockaddr)
                return None
            except OSError as e:
                code = e.errno
                if code == errno.ECONNREFUSED and not listener:
                    return None  # the host answered; its port opens when node 0 starts
                if code in UNREACHABLE or isinstance(e, socket.timeout) and time.monotonic() > deadline:
                    return UserError(f"launcher.master_addr={addr} cannot be reached from this node "
                                     f"({e.strerror or 'timed out'}).", "launcher.master_addr=<node 0's address as "
                                     "this node sees it> (check the network, NCCL/GLOO_SOCKET_IFNAME).",
                                     key=key, value=addr)
        if time.monotonic() > deadline:
            return UserError(f"nothing listens on {addr}:{port} after {wait_s:.0f} s: node 0 has not started, or "
                             "launcher.master_addr/master_port differ from node 0's.", "start node 0 with the same "
                             "launcher.master_addr and launcher.master_port (or raise launcher.join_timeout_s).",
                             key=key, value=addr)
        if not said:
            log(f"waiting for node 0 at {addr}:{port} (up to {wait_s:.0f} s) ...")
            said = True
        time.sleep(1)

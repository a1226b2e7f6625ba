"""DeepSpeed hostfiles, validated before anything starts.

DeepSpeed's parser (launcher/runner.py ``_parse_hostfile``) takes the first run of non-blank characters of
each line as the host, and that string reaches pdsh/ssh and a shell: ``$(touch x) slots=1`` or
``-oProxyCommand=... slots=1`` would run commands on the launching machine. zerorun accepts only what a
hostfile is for, ``HOST slots=N`` with an optional comment, where HOST is a DNS name, an IPv4 or IPv6 address,
optionally ``user@`` before it, and refuses anything else naming the line (exit 2, nothing started).
"""
from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Dict, List, Tuple

from .config.errors import UserError

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)\s*(?:#.*)?$")
KEY = "launcher.hostfile"


def host_ok(host: str) -> bool:
    """A DNS name or an IP literal, optionally ``user@`` before it: nothing a shell or ssh reads as more."""
    if any(c in host for c in "%,[]"):  # an IPv6 zone id takes anything; pdsh splits hosts at commas
        return False
    user, at, name = host.rpartition("@")
    if at and not _USER.match(user):
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return len(name) <= 253 and bool(_DNS.match(name))


def parse(text: str, path: str = "hostfile") -> Tuple[Dict[str, int], List[UserError]]:
    """(host → slots in file order, every problem with its line). Blank lines and ``#`` comments are skipped."""
    hosts: Dict[str, int] = {}
    problems: List[UserError] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{n}: {line!r}"
        m = _LINE.match(line)
        if not m:
            problems.append(UserError(f"{where} is not 'HOST slots=N'.", "one 'HOST slots=N' per line, e.g. "
                                      "'worker-1 slots=8'.", key=KEY, value=path))
            continue
        host, slots = m.group("host"), m.group("slots")
        if not host_ok(host):
            problems.append(UserError(f"{where}: {host!r} is not a host name or address (it would reach ssh and a "
                                      "shell as it is).", "a DNS name, an IPv4/IPv6 address, optionally user@ before "
                                      "it.", key=KEY, value=path))
        elif not slots.isdecimal() or not slots.isascii() or int(slots) < 1:
            problems.append(UserError(f"{where}: slots={slots} must be a whole number of at least 1.",
                                      "slots=<ranks on that host>, e.g. slots=8.", key=KEY, value=path))
        elif host in hosts:
            problems.append(UserError(f"{where}: {host} is listed twice.", "one line per host.", key=KEY, value=path))
        else:
            hosts[host] = int(slots)
    if not hosts and not problems:
        problems.append(UserError(f"{path} lists no host.", "one 'HOST slots=N' line per node.", key=KEY, value=path))
    return hosts, problems


def problems(path: str, nnodes: int) -> List[UserError]:
    """Every problem with the hostfile at ``path`` for a job of ``nnodes`` nodes."""
    from .config.paths import file_problem

    why = file_problem(path)
    if why:
        return [UserError(f"launcher.hostfile={path}: {why}.", "the path of a file with 'HOST slots=N' lines.",
                          key=KEY, value=path)]
    p = Path(path)
    hosts, out = parse(p.read_text(errors="replace"), path)
    if not out and nnodes > len(hosts):
        out.append(UserError(f"launcher.nnodes={nnodes} but {path} lists {len(hosts)} host(s).",
                             f"launcher.nnodes={len(hosts)}, or add hosts.", key="launcher.nnodes", value=nnodes))
    return out

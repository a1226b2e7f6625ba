"""Hostfiles: what DeepSpeed would hand to pdsh/ssh and a shell is refused, naming the line."""
import pytest

from zerorun import hostfile

GOOD = """# two nodes
worker-0 slots=2
10.0.0.2   slots=2   # the second
ubuntu@node3.cluster.local slots=8
fe80::1 slots=1
"""


def test_a_good_hostfile_parses_in_order():
    hosts, problems = hostfile.parse(GOOD)
    assert problems == []
    assert hosts == {"worker-0": 2, "10.0.0.2": 2, "ubuntu@node3.cluster.local": 8, "fe80::1": 1}


INJECTION = [
    "$(touch /tmp/pwned) slots=1",
    "`id` slots=1",
    "host;rm slots=1",
    "host|nc slots=1",
    "host&&x slots=1",
    "-oProxyCommand=sh slots=1",
    "-F/tmp/cfg slots=1",
    "worker-0' slots=1",
    'worker"0 slots=1',
    "a@b@c slots=1",
    "-user@host slots=1",
    "host\\x slots=1",
    "-worker slots=1",
    "worker- slots=1",
    "host>out slots=1",
    "{a,b} slots=1",
    "fe80::1%$(touch${IFS}x) slots=1",
    "fe80::1%`id` slots=1",
    "fe80::1%x,-oProxyCommand=id slots=1",
    "a,b slots=1",
    "[fe80::1] slots=1",
]
BAD_SLOTS = ["worker-0 slots=0", "worker-0 slots=-1", "worker-0 slots=two", "worker-0 slots=1.5",
             "worker-0", "worker-0 slots=2 extra", "worker-0 slots=", "slots=2", "worker-0 slots=²"]


@pytest.mark.parametrize("line", INJECTION + BAD_SLOTS)
def test_each_bad_line_is_refused_naming_it(line):
    hosts, problems = hostfile.parse(f"good-0 slots=1\n{line}\n", "hf")
    assert len(problems) == 1, (line, problems)
    message = str(problems[0])
    assert "hf:2:" in message and problems[0].key == "launcher.hostfile"
    assert "good-0" in hosts and len(hosts) == 1


def test_duplicates_empty_missing_and_too_few_hosts(tmp_path):
    assert "listed twice" in str(hostfile.parse("a slots=1\na slots=2\n")[1][0])
    assert "no host" in str(hostfile.parse("# nothing\n\n")[1][0])
    assert "no such file" in str(hostfile.problems(str(tmp_path / "none"), 2)[0])
    f = tmp_path / "hf"
    f.write_text("a slots=1\n")
    assert hostfile.problems(str(f), 1) == []
    (p,) = hostfile.problems(str(f), 2)
    assert p.key == "launcher.nnodes" and "lists 1 host" in str(p)

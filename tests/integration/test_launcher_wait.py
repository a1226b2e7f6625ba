"""zerorun.launcher.run against a stand-in launcher: when the ranks are done, the launcher is not waited for."""
import pytest

pytestmark = pytest.mark.integration


def _launcher_script(tmp_path, ranks_mark: bool, launcher_rc: int):
    """A stand-in launcher: two "ranks" that exit at once (marking a clean exit or not); the launcher itself
    lingers 30 s as the deepspeed CLI's poll-and-sleep does, then exits with ``launcher_rc``."""
    import sys

    rank = ("import os, sys; from zerorun import faults; "
            + ("faults.mark_clean_exit(sys.argv[1]); " if ranks_mark else "") + "os._exit(0)")
    script = tmp_path / "launch.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        f"ps = [subprocess.Popen([sys.executable, '-c', {rank!r}, {str(tmp_path)!r}], "
        "env={**os.environ, 'LOCAL_RANK': str(r)}) for r in range(2)]\n"
        "[p.wait() for p in ps]\n"
        f"time.sleep(0.5 if {launcher_rc} else 30)\n"
        f"sys.exit({launcher_rc})\n")
    return [sys.executable, str(script)]


def test_ranks_that_exited_cleanly_end_the_wait_without_the_launchers_linger(tmp_path):
    import time

    from zerorun import faults
    from zerorun.launcher import run

    key = "host-123"
    t0 = time.monotonic()
    rc = run(_launcher_script(tmp_path, True, 0), {faults.NODE_KEY_ENV: key},
             lambda: faults.clean_exits(tmp_path, key) >= 2)
    assert rc == 0 and time.monotonic() - t0 < 15  # the stand-in launcher would linger 30 s
    assert faults.clean_exits(tmp_path, "another-node") == 0  # keyed by node: a shared run dir's other node
    faults.forget_clean_exits(tmp_path, key)
    assert faults.clean_exits(tmp_path, key) == 0 and faults.read_all(tmp_path) == []


def test_without_clean_exit_markers_the_launchers_own_exit_code_is_waited_for(tmp_path):
    from zerorun import faults
    from zerorun.launcher import run

    rc = run(_launcher_script(tmp_path, False, 3), {faults.NODE_KEY_ENV: "k"}, lambda: faults.clean_exits(tmp_path, "k") >= 2)
    assert rc == 3 and faults.clean_exits(tmp_path, "k") == 0

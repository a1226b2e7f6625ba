"""benchmarks/rss_validation.py's timeout kills a draw whole: zerorun starts the deepspeed launcher in a session of
its own, so killing zerorun's process group left the launcher and its ranks running with the output pipe open, and
the set waited on them (35 min on a bf16 GPT-2 draw whose 900 s timeout had fired)."""
import os
import subprocess
import sys
import threading

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import rss_validation as R  # noqa: E402

pytestmark = pytest.mark.integration

MARK = f"317.{os.getpid()}"  # a sleep no other process runs


def left_running():
    args = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [a for a in args if a.strip() == f"sleep {MARK}"]


def test_a_timed_out_draw_is_killed_with_what_it_started_in_sessions_of_their_own():
    # a parent that starts a child in its own session, as zerorun starts deepspeed, and holds on
    parent = ("import subprocess, time; subprocess.Popen(['sleep', '%s'], start_new_session=True); time.sleep(300)"
              % MARK)
    outcome = []

    def draw():
        try:
            R._run_bounded([sys.executable, "-c", parent], None, 2)
        except RuntimeError as e:
            outcome.append(str(e))

    waiting = threading.Thread(target=draw, daemon=True)  # a regression waits forever: fail instead of hanging
    try:
        waiting.start()
        waiting.join(60)
        assert not waiting.is_alive(), "the timed-out draw is still waited on"
        assert outcome and "still running after 2 s" in outcome[0]
        assert not left_running()
    finally:
        subprocess.run(["pkill", "-f", f"^sleep {MARK}$"])

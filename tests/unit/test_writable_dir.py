"""hardware.writable_dir_problem: the run-directory probe every node of a job makes before it launches."""
import os

import pytest

from zerorun import hardware

pytestmark = pytest.mark.unit


def test_a_directory_another_node_removes_under_the_probe_is_tried_again(tmp_path, monkeypatch):
    # Two Slurm tasks probe the same shared run dir at once: one's clean-up removed what the other had just
    # made, and the node refused to launch with "No such file or directory" (seen in CI, test_platform_jobs).
    target = tmp_path / "runs" / "job-1"
    real = hardware.uuid.uuid4
    removed = []

    def remove_once():  # called between makedirs and the probe's write
        if not removed:
            os.rmdir(target)
            os.rmdir(target.parent)
            removed.append(True)
        return real()

    monkeypatch.setattr(hardware.uuid, "uuid4", remove_once)
    assert hardware.writable_dir_problem(str(target)) is None and removed
    assert not (tmp_path / "runs").exists()  # the probe leaves nothing behind


def test_a_path_that_cannot_be_a_directory_still_says_why(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert hardware.writable_dir_problem(str(blocker / "runs")) == os.strerror(20)  # ENOTDIR
    assert hardware.writable_dir_problem(str(tmp_path / "fine")) is None

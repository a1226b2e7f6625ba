"""Which DeepSpeed JIT ops a run loads (pure), and the cheap check that one is already built."""
import time

import pytest

from helpers import composed
from zerorun import ops
from zerorun.config import OffloadDevice, OptimizerImpl
from zerorun.launcher import extensions_dir


@pytest.mark.parametrize("optimizer, offload, expected", [
    (OptimizerImpl.torch_adamw, OffloadDevice.none, []),  # the demo (CPU ranks skip DeepSpeed's shm comm op)
    (OptimizerImpl.cpu_adam, OffloadDevice.cpu, ["cpu_adam"]),
    (OptimizerImpl.cpu_adam, OffloadDevice.nvme, ["cpu_adam", "async_io"]),
    (OptimizerImpl.fused_adam, OffloadDevice.none, ["fused_adam"]),
    (OptimizerImpl.torch_sgd, OffloadDevice.cpu, []),  # a client optimizer steps itself on the host
])
def test_needed(optimizer, offload, expected):
    assert [name for name, _ in ops.needed(optimizer, offload)] == expected


def test_needed_says_why():
    assert dict(ops.needed(OptimizerImpl.cpu_adam, OffloadDevice.nvme)) == {
        "cpu_adam": "offload=nvme", "async_io": "offload=nvme"}


@pytest.mark.parametrize("overrides, expected", [
    ((), []),  # the default job: torch's AdamW, no offload
    (("zero=stage2", "offload=cpu"), ["cpu_adam"]),
    (("zero=stage3", "offload=nvme"), ["cpu_adam", "async_io"]),
    (("zero=stage2", "offload=cpu", "optimizer=sgd"), []),
])
def test_needed_for_config(overrides, expected):
    assert [name for name, _ in ops.needed_for(composed(*overrides), "cpu")] == expected


def test_built_is_a_stat(tmp_path):
    (tmp_path / "cpu_adam").mkdir()
    assert not ops.built("cpu_adam", str(tmp_path)) or _installed_in_deepspeed("cpu_adam")
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    t0 = time.perf_counter()
    for _ in range(100):
        assert ops.built("cpu_adam", str(tmp_path))
    assert time.perf_counter() - t0 < 0.5  # 100 checks: a launch pays nothing when its ops are built


def test_an_op_built_here_is_found():
    """The venv's own build (make ops built cpu_adam into extensions_dir()) counts as built, and checking
    imports nothing heavy."""
    import sys

    if not (ops.built("cpu_adam", extensions_dir())):
        pytest.skip(f"cpu_adam not built in {extensions_dir()} (make ops builds it)")
    had_deepspeed = "deepspeed" in sys.modules
    t0 = time.perf_counter()
    assert ops.built("cpu_adam", extensions_dir())
    assert time.perf_counter() - t0 < 0.05
    assert ("deepspeed" in sys.modules) == had_deepspeed


def test_ensure_builds_nothing_when_built(tmp_path):
    for name in ops.OPS:
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").write_bytes(b"")
    lines = []
    ops.ensure(ops.needed(OptimizerImpl.cpu_adam, OffloadDevice.nvme), "cpu", lines.append,
               ext_dir=str(tmp_path))  # a build would start a process: refused in unit tests
    assert lines == []


def _installed_in_deepspeed(name):
    return ops.built(name, "/nonexistent")


@pytest.mark.parametrize("name, flags, is_built", [
    ("cpu_adam", "-fPIC -std=c++20 -O3 -g -Wno-reorder -march=native", False),  # DeepSpeed's default: recompiled
    ("cpu_adam", "-fPIC -std=c++20 -O3 -Wno-reorder -march=native -ggdb3", True),  # only the exact flag matters
    ("cpu_adam", "-fPIC -std=c++20 -O3 -Wno-reorder -march=native", True),
    ("async_io", "-fPIC -std=c++20 -O0 -Wno-reorder", False),  # an earlier zerorun's, without the header
    ("async_io", "-fPIC -std=c++20 -O0 -Wno-reorder -I/x/async_io.pch -include torch/extension.h", True),
    ("async_io", "-fPIC -std=c++20 -O0 -g -I/x/async_io.pch -include torch/extension.h", False),
])
def test_an_op_built_with_other_flags_is_not_built(tmp_path, name, flags, is_built):
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"")
    (tmp_path / name / "build.ninja").write_text(f"ninja_required_version = 1.3\ncxx = c++\n\ncflags = "
                                                 f"-DTORCH_EXTENSION_NAME={name} {flags}\npost_cflags =\n")
    assert ops.built(name, str(tmp_path)) == (is_built or _installed_in_deepspeed(name))



@pytest.mark.parametrize("value, expected", [
    ("9.0a", "9.0"),  # an H100 image's: DeepSpeed 0.19's int("0a") failed every op load
    ("8.0 9.0a+PTX", "8.0;9.0+PTX"),
    ("8.0;8.6;9.0;9.0a;10.0f", "8.0;8.6;9.0;10.0"),
    ("7.5", "7.5"),
])
def test_deepspeed_arch_list(value, expected):
    assert ops.deepspeed_arch_list(value) == expected


@pytest.mark.heavy
def test_a_build_lock_whose_owner_died_is_taken_over_and_said(tmp_path):
    """A build stopped by Ctrl-C leaves torch's lock file; the next load takes it over instead of waiting forever."""
    lines = []
    baton = ops.owned_baton(lines.append)
    lock = tmp_path / "lock"
    pid = ops._me().split()[0]
    lock.write_text(f"{pid} 12.00")  # this pid, another start time: a process that has ended, its pid reused
    assert ops.stale(str(lock))
    held = baton(str(lock))
    assert held.try_acquire()
    assert lock.read_text() == ops._me() and lines == [f"removed {lock}: its build (pid {pid}) stopped before it ended"]
    held.release()
    assert not lock.exists()


@pytest.mark.heavy
def test_a_live_or_unowned_build_lock_is_waited_on(tmp_path):
    """A lock whose owner runs, and torch's own (no owner written: a process without zerorun's lock), are held."""
    baton = ops.owned_baton(lambda line: None)
    live = baton(str(tmp_path / "lock"))
    assert live.try_acquire() and not baton(str(tmp_path / "lock")).try_acquire()
    live.release()
    (tmp_path / "lock").write_text("")
    assert not ops.stale(str(tmp_path / "lock")) and not baton(str(tmp_path / "lock")).try_acquire()


@pytest.mark.heavy
def test_waiting_ends_when_the_owner_dies(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("999999999 1.00")  # no such pid
    t0 = time.monotonic()
    ops.owned_baton(lambda line: None)(str(lock)).wait()
    assert not lock.exists() and time.monotonic() - t0 < 5

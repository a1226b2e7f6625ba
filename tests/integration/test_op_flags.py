"""The flags DeepSpeed's op builders compile with in a zerorun process (their cxx_args probe the CPU with a
subprocess, so not a unit test), and the precompiled header async_io's units share (ninja and a compiler run)."""
import os
import shutil
import subprocess
import sys

import pytest

from zerorun import ops


def test_the_builders_zerorun_loads_compile_without_debug_info_and_async_io_on_a_precompiled_header():
    """What the prebuild and every rank compile with (else the first rank to load an op would recompile it)."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    before = {n: accel.create_op_builder(n).cxx_args() for n in ops._BUILDERS if accel.get_op_builder(n)}
    ops.set_build_flags()
    ops.set_build_flags()  # once per process, however often it is called
    after = {n: accel.create_op_builder(n).cxx_args() for n in before}
    assert "CPUAdamBuilder" in after and all(ops.DEBUG_FLAG not in a for a in after.values()), after
    for n in before:
        extra = ["-include", ops.PCH_HEADER] if accel.create_op_builder(n).name in ops.PCH_OPS else []
        assert after[n][:len(after[n]) - len(extra) - bool(extra)] == [a for a in before[n] if a != ops.DEBUG_FLAG]
        assert after[n][len(after[n]) - len(extra):] == extra, (n, after[n])
    assert any(ops.PCH_HEADER in a for a in after.values())  # async_io's builder is among them


def _fake_op_build(tmp_path, name="async_io"):
    """An extensions folder as torch leaves it right before ninja runs: build.ninja with one unit to compile, a
    torch include dir holding torch/extension.h, and a 'compiler' that records its arguments."""
    include = tmp_path / "torch-include"
    (include / "torch").mkdir(parents=True)
    (include / "torch" / "extension.h").write_text("#pragma once\n")
    cxx = tmp_path / "fake c++"
    cxx.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$(dirname "$0")/args.txt"\n'
                   'while [ "$1" != "-o" ]; do shift; done; touch "$2"\n')
    cxx.chmod(0o755)
    ext = tmp_path / "ext"
    build = ext / name
    build.mkdir(parents=True)
    (build / "unit.cpp").write_text("int x;\n")
    pch = ops.pch_dir(str(ext), name)
    (build / "build.ninja").write_text(
        f"ninja_required_version = 1.3\ncxx = '{cxx}'\n\n"
        f"cflags = -DTORCH_EXTENSION_NAME={name} -isystem {include} -fPIC -O0 -I{pch} -include torch/extension.h\n"
        "post_cflags = -std=c++20\n\nrule compile\n  command = $cxx $cflags -c $in -o $out $post_cflags\n\n"
        f"build unit.o: compile {build / 'unit.cpp'}\n")
    return build, include, pch


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja not installed")
def test_the_header_is_precompiled_with_the_units_own_flags_and_only_when_ninja_has_work(tmp_path):
    build, include, pch = _fake_op_build(tmp_path)
    lines = []
    where = ops.precompile_header(str(build), "async_io", lines.append)
    assert where == pch and os.path.isfile(os.path.join(pch, "torch", "extension.h.gch")), lines
    assert os.path.realpath(os.path.join(pch, "torch", "extension.h")) == str(include / "torch" / "extension.h")
    args = (tmp_path / "args.txt").read_text().split("\n")
    # The units' flags, post_cflags included, without the two that point at the header being made.
    assert args[:5] == ["-DTORCH_EXTENSION_NAME=async_io", "-isystem", str(include), "-fPIC", "-O0"], args
    assert "-std=c++20" in args and "-include" not in args and f"-I{pch}" not in args, args
    assert args[args.index("-x") + 1:args.index("-x") + 3] == ["c++-header", os.path.join(pch, "torch", "extension.h")]
    assert lines and "precompiled" in lines[0]
    assert ops.precompile_header(str(build), "cpu_adam", lines.append) is None  # not a PCH op
    subprocess.run(["ninja", "-C", str(build)], check=True, capture_output=True)  # built: nothing left to do,
    (tmp_path / "args.txt").unlink()  # so no ~70 s header compile
    assert ops.precompile_header(str(build), "async_io", lines.append) is None
    assert not (tmp_path / "args.txt").exists()


def test_a_build_stopped_by_a_kill_does_not_hang_the_next_load_of_its_op():
    """A kill (or Ctrl-C) while an op builds leaves torch's lock file in its folder, and every later load of the
    op, the prebuild's and each rank's (torch takes the lock even to load a built one), waited on it forever."""
    ext_dir = ops.extensions_dir_in_use()
    if not ops.built("cpu_adam", ext_dir):
        pytest.skip("cpu_adam is not built here (make ops)")
    lock = os.path.join(ext_dir, "cpu_adam", "lock")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": ext_dir}
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, torch.utils.cpp_extension as ext; from zerorun import ops; "
         "ops.set_build_flags(); baton = ext.FileBaton(sys.argv[1])\n"
         "while not baton.try_acquire(): time.sleep(0.05)  # a rank of another test may be loading it\n"
         "print('held', flush=True); time.sleep(600)", lock], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline() == "held\n"
    holder.kill()
    holder.wait()
    assert os.path.exists(lock)  # what the kill leaves
    done = subprocess.run([sys.executable, "-m", "zerorun.prebuild", "cpu_adam"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"removed {lock}: its build (pid {holder.pid}) stopped before it ended" in done.stderr
    assert not os.path.exists(lock)

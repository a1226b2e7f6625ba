"""The flags DeepSpeed's op builders compile with in a zerorun process (their cxx_args probe the CPU with a
subprocess, so not a unit test)."""
from zerorun import ops


def test_the_builders_zerorun_loads_compile_without_debug_info():
    """What the prebuild and every rank compile with (else the first rank to load an op would recompile it)."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    before = {n: accel.create_op_builder(n).cxx_args() for n in ops._BUILDERS if accel.get_op_builder(n)}
    ops.without_debug_info()
    ops.without_debug_info()  # once per process, however often it is called
    after = {n: accel.create_op_builder(n).cxx_args() for n in before}
    assert "CPUAdamBuilder" in after and all(ops.DEBUG_FLAG not in a for a in after.values()), after
    assert all([a for a in before[n] if a != ops.DEBUG_FLAG] == after[n] for n in before), (before, after)

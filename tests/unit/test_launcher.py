"""LaunchPlan → argv/env, tested without starting a process."""
import os

import pytest

from zerorun.launcher import LaunchPlan, build_command, cpu_shm_name, node_hostfile, release_cpu_shm, shell_line


def plan(**kw):
    base = dict(launcher="deepspeed", run_dir="/runs/a b", nproc_per_node=2, accelerator="cpu", master_port=29511)
    base.update(kw)
    return LaunchPlan(**base)


def test_deepspeed_single_node_cpu():
    argv, env = build_command(plan())
    assert argv == ["deepspeed", "--num_gpus", "2", "--master_port", "29511", "--no_local_rank",
                    "--module", "zerorun.train", "/runs/a b"]
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1"


def test_deepspeed_gpu_has_no_cpu_accelerator_env():
    argv, env = build_command(plan(accelerator="cuda", nproc_per_node=8))
    assert "DS_ACCELERATOR" not in env and argv[argv.index("--num_gpus") + 1] == "8"


def test_deepspeed_hostfile_multi_node():
    argv, _ = build_command(plan(accelerator="cuda", hostfile="/etc/hosts.ds", nnodes=4, master_addr="node0"))
    assert argv[1:9] == ["--hostfile", "/etc/hosts.ds", "--num_nodes", "4", "--master_addr", "node0",
                         "--num_gpus", "2"]


def test_deepspeed_node_by_node_without_ssh():
    argv, _ = build_command(plan(nnodes=2, node_rank=1, master_addr="10.0.0.1"))
    assert argv[1:11] == ["--hostfile", "/runs/a b/hostfile.node1", "--no_ssh", "--node_rank", "1", "--num_nodes",
                          "2", "--master_addr", "10.0.0.1", "--num_gpus"]
    assert node_hostfile(2, 4) == "node0 slots=4\nnode1 slots=4\n"


def test_torchrun_c10d_rendezvous_any_order_and_elastic():
    argv, _ = build_command(plan(launcher="torchrun", nnodes=3, rdzv="c10d", rdzv_id="job7", min_nnodes=2,
                                 master_addr="10.0.0.1"))
    assert argv[3:11] == ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29511",
                          "--rdzv-id", "job7"]
    assert "--node-rank" not in argv and argv[argv.index("--rdzv-conf") + 1] == "is_host=false"


def test_torchrun_single_and_multi_node():
    argv, _ = build_command(plan(launcher="torchrun"))
    assert argv == ["torchrun", "--nproc-per-node", "2", "--nnodes", "1", "--master-addr", "127.0.0.1",
                    "--master-port", "29511", "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
                    "--shutdown-timeout", "110", "-m", "zerorun.train", "/runs/a b"]
    argv, _ = build_command(plan(launcher="torchrun", nnodes=2, node_rank=1, master_addr="10.0.0.1"))
    assert argv[3:11] == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29511"]


def test_shell_line_quotes():
    argv, env = build_command(plan())
    line = shell_line(argv, env)
    assert "'/runs/a b'" in line and line.startswith("DS_ACCELERATOR=cpu ")


def test_bin_dir_is_used_when_the_script_exists(tmp_path):
    (tmp_path / "deepspeed").write_text("")
    argv, _ = build_command(plan(bin_dir=str(tmp_path)))
    assert argv[0] == str(tmp_path / "deepspeed")
    argv, _ = build_command(plan(launcher="torchrun", bin_dir=str(tmp_path)))
    assert argv[0] == "torchrun"  # not in bin_dir: fall back to PATH


def test_cpu_shm_segments_of_one_run_are_released(tmp_path):
    """DeepSpeed names its per-rank CPU all-reduce segment after uid, master address, port and rank; only
    the segments of the given run go."""
    assert cpu_shm_name("127.0.0.1", 29511, 1, uid=0) == "deepspeed_allreduce_buffer_0_127.0.0.1_29511_1"
    mine = [tmp_path / cpu_shm_name("127.0.0.1", 29511, r) for r in (0, 1)]
    other = tmp_path / cpu_shm_name("127.0.0.1", 29512, 0)
    for f in (*mine, other):
        f.write_bytes(b"x" * 10)
    assert release_cpu_shm("127.0.0.1", 29511, shm_dir=str(tmp_path)) == 20
    assert not any(f.exists() for f in mine) and other.exists()
    assert release_cpu_shm("127.0.0.1", 29511, shm_dir=str(tmp_path)) == 0
    assert str(os.getuid()) in cpu_shm_name("h", 1)


@pytest.mark.heavy
def test_the_launcher_reads_this_machine_without_importing_torch_where_it_can(tmp_path, monkeypatch):
    """detect() answers fp16 support from the CPU flags as torch's own mkldnn check does, and on a machine
    with no NVIDIA device node it does not import torch (~1 s of every launch) to look for CUDA."""
    import builtins

    import torch

    from zerorun import hardware

    if hardware._cpu_flags() is not None:
        assert hardware._cpu_fp16_supported() == bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse avx512f avx512_fp16\n")
    assert hardware._cpu_flags(str(info)) == {"fpu", "sse", "avx512f", "avx512_fp16"}
    real_import = builtins.__import__
    attempted = []

    def no_torch(name, *args, **kwargs):  # detect() swallows import errors, so record instead of raising
        attempted.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(hardware, "_nvidia_smi_memory", lambda: None)
    monkeypatch.setattr(hardware, "_gpu_device_nodes", lambda: False)
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: {"fpu"})
    monkeypatch.setattr(builtins, "__import__", no_torch)
    hw = hardware.detect()
    assert hw.accelerator == "cpu" and hw.fp16_ok is False
    assert "torch" not in attempted, attempted
    monkeypatch.setattr(hardware, "_gpu_device_nodes", lambda: True)  # a GPU node but no nvidia-smi: ask CUDA
    hardware.detect()
    assert "torch" in attempted


def test_cuda_ranks_get_expandable_segments_unless_turned_off_or_set_by_the_user(monkeypatch):
    from zerorun.launcher import CUDA_ALLOC_CONF, rank_env

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert rank_env("cuda", 4)["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_ALLOC_CONF == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_env("cuda", 4, expandable_segments=False)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_env("cpu", 1)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")  # the user's own wins (inherited)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_env("cuda", 4)


def test_cpu_ranks_bound_the_16_bit_kernel_caches_unless_the_user_set_them(monkeypatch):
    from zerorun.launcher import KERNEL_CACHE_ENTRIES, KERNEL_CACHE_VARIABLES, rank_env

    for name in KERNEL_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cpu = rank_env("cpu", 1)
    assert {k: cpu[k] for k in KERNEL_CACHE_VARIABLES} == {k: str(KERNEL_CACHE_ENTRIES) for k in KERNEL_CACHE_VARIABLES}
    assert not set(KERNEL_CACHE_VARIABLES) & set(rank_env("cuda", 4))  # GPU ranks run no oneDNN matmul
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "1024")  # the user's own wins (inherited by the ranks)
    cpu = rank_env("cpu", 1)
    assert "LRU_CACHE_CAPACITY" not in cpu and cpu["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_ENTRIES)

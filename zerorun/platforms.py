"""Where zerorun runs decides part of its config: SageMaker and Slurm tell each node who it is.

``detect(environ, argv)`` turns a platform's contract into overrides placed before the user's own (a key the
user gives is never overridden), so ``zerorun`` is the whole entry point: no script around it. Pure: it reads
the environment and files it is handed and returns what to add; cli.py applies it.

SageMaker (sagemaker-training toolkit and SDK v3 contract): hosts, the current host and the network interface
from SM_* or ``input/config/resourceconfig.json`` under ``SAGEMAKER_BASE_DIR`` (default /opt/ml);
hyperparameters from ``hyperparameters.json``/SM_HPS and the ``--key value`` argv the toolkit passes;
channels → data paths; the export → SM_MODEL_DIR; the run dir under output/data; checkpoints in
/opt/ml/checkpoints (synced to S3 and copied back on a restart: the job resumes from them).

Slurm (one task per node, started by srun): nnodes, node rank and master from SLURM_*; a port derived from
the job id; the run dir is per job, so a requeued job (same id) resumes from it.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .checkpoint import complete_tags
from .config.errors import UserError

SAGEMAKER_PORT = 7777  # the toolkit's and SDK's MASTER_PORT
RANK_VARS = ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK")


@dataclass
class Platform:
    name: str                      # "sagemaker" | "slurm"
    overrides: List[str]           # before the user's
    env: Dict[str, str] = field(default_factory=dict)  # set when absent (socket interface)
    requeue: List[str] = field(default_factory=list)   # Slurm: argv that requeues the job after a preemption
    node_rank: int = 0
    notes: List[str] = field(default_factory=list)


def env_int(environ: Mapping[str, str], name: str, default: int = 0, *, lo: int = 0, hi: int = 2**31 - 1) -> int:
    """An integer the platform put in ``name`` (unset or empty: ``default``); a malformed or out-of-range value is
    the one-line error naming the variable, never a traceback. Every platform variable is read through this."""
    raw = (environ.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise UserError(f"{name}={raw!r} in the environment: expected an integer in [{lo}, {hi}].",
                        f"this variable is the platform's (the scheduler sets it): unset it in your shell or job "
                        f"script, or set it to a valid value.", key=name, value=raw)
    return value


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merged(platform: Platform, user: Sequence[str]) -> List[str]:
    """The platform's overrides for keys the user does not give, then the user's."""
    given = {_key(a) for a in user if "=" in a}
    return [o for o in platform.overrides if _key(o) not in given] + list(user)


def detect(environ: Mapping[str, str], argv: Sequence[str]) -> Optional[Platform]:
    if _sagemaker_base(environ) is not None:
        return sagemaker(environ, argv)
    if environ.get("SLURM_JOB_ID"):
        return slurm(environ)
    return None


# ------------------------------------------------------------------------------------------------- SageMaker
def _sagemaker_base(environ: Mapping[str, str]) -> Optional[Path]:
    base = Path(environ.get("SAGEMAKER_BASE_DIR", "/opt/ml"))
    if "SM_TRAINING_ENV" in environ or (base / "input" / "config" / "resourceconfig.json").is_file():
        return base
    return None


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise UserError(f"SageMaker: {path} is not valid JSON ({e}).", f"fix the {what}.", key=what) from None


def hyperparameters(environ: Mapping[str, str], base: Path, argv: Sequence[str]) -> Dict[str, Any]:
    """The user's hyperparameters: hyperparameters.json (or SM_HPS), then ``--key value`` pairs of argv.
    SageMaker stores every value as a string holding JSON; ``sagemaker_*`` keys are the platform's."""
    raw = _read_json(base / "input" / "config" / "hyperparameters.json", "hyperparameters")
    if raw is None and environ.get("SM_HPS"):
        try:
            raw = json.loads(environ["SM_HPS"])
        except ValueError as e:
            raise UserError(f"SageMaker: SM_HPS is not valid JSON ({e}).", "fix the estimator's hyperparameters.",
                            key="hyperparameters") from None
    if raw is not None and not isinstance(raw, dict):
        raise UserError(f"SageMaker: the hyperparameters (SM_HPS or hyperparameters.json) are not a JSON object: "
                        f"{str(raw)[:80]!r}.", "fix the estimator's hyperparameters (a dict of key: value).",
                        key="SM_HPS" if environ.get("SM_HPS") else "hyperparameters", value=raw)
    hps: Dict[str, Any] = {}
    for k, v in (raw or {}).items():
        if k.startswith("sagemaker_"):
            continue
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                if v.strip()[:1] in ('{', '[', '"'):  # meant as JSON, and broken
                    raise UserError(f"SageMaker: hyperparameter {k} = {v!r} is not valid JSON ({e}).",
                                    "fix the value in the estimator's hyperparameters.", key=k, value=v) from None
                # a plain word (generic Estimators pass str(value)): kept, as the toolkit does
        hps[k] = v
    hps.update(split_argv(argv)[0])
    return hps


def split_argv(argv: Sequence[str]) -> Tuple[Dict[str, Any], List[str]]:
    """The toolkit's (and SDK v3's) ``--key value`` pairs as hyperparameters (values JSON-decoded where they
    parse), and the words that are Hydra overrides already (``key=value``); the ``train`` argument SageMaker
    gives a bring-your-own container is dropped."""
    pairs: Dict[str, Any] = {}
    words: List[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("-") and "=" not in a and i + 1 < len(argv):
            value = argv[i + 1]
            try:
                value = json.loads(value)
            except ValueError:
                pass
            pairs[a.lstrip("-")] = value
            i += 2
            continue
        if not (i == 0 and a == "train"):
            words.append(a)
        i += 1
    return pairs, words


_PLAIN = re.compile(r"^[\w./:@+\-]*$")


def _value(v: Any) -> str:
    """A hyperparameter value in Hydra's override grammar."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_value(x)}" for k, x in v.items()) + "}"
    s = str(v)
    return s if s and _PLAIN.match(s) else "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def hp_overrides(hps: Mapping[str, Any]) -> List[str]:
    """``{"zero": "stage3", "trainer.lr": 1e-4, "model": "gpt2"}`` → Hydra overrides. ``overrides`` holds a
    whole override string; ``model`` is the ``+model`` group (not in the defaults list)."""
    out: List[str] = []
    for k, v in hps.items():
        if k == "overrides":
            out += shlex.split(str(v))
        elif not re.match(r"^[+~]{0,2}[A-Za-z_][\w.]*$", k):
            raise UserError(f"SageMaker: hyperparameter {k!r} is not a config key.",
                            "name a zerorun config key (e.g. trainer.lr, zero, +model), or pass "
                            "overrides='key=value ...'.", key="hyperparameters", value=k)
        else:
            out.append(f"{'+model' if k == 'model' else k}={_value(v)}")
    return out


def sagemaker(environ: Mapping[str, str], argv: Sequence[str]) -> Platform:
    base = _sagemaker_base(environ) or Path("/opt/ml")
    started = [v for v in RANK_VARS if v in environ]
    if started:
        raise UserError(f"SageMaker started the ranks already ({started[0]} is set: the estimator's "
                        "`distribution` runs one process per GPU), and zerorun starts its own.",
                        "remove `distribution=` from the estimator: zerorun runs once per instance and starts "
                        "that instance's ranks itself.", key="distribution")
    resource = _read_json(base / "input" / "config" / "resourceconfig.json", "resourceconfig.json") or {}
    try:
        hosts = json.loads(environ["SM_HOSTS"]) if environ.get("SM_HOSTS") else resource.get("hosts") or []
    except ValueError as e:
        raise UserError(f"SageMaker: SM_HOSTS is not valid JSON ({e}).", "it is the platform's; report it.",
                        key="SM_HOSTS") from None
    if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
        raise UserError(f"SageMaker: SM_HOSTS / resourceconfig.json hosts must be a JSON list of host names, not "
                        f"{str(hosts)[:80]!r}.", "it is the platform's; unset SM_HOSTS if you set it.", key="SM_HOSTS",
                        value=hosts)
    current = environ.get("SM_CURRENT_HOST") or resource.get("current_host") or ""
    hosts = sorted(hosts) or [current]
    if current not in hosts:
        raise UserError(f"SageMaker: the current host {current!r} is not in the host list {hosts} "
                        "(SM_CURRENT_HOST / resourceconfig.json).",
                        "the instance's resourceconfig.json must list it; check SAGEMAKER_BASE_DIR.",
                        key="SM_CURRENT_HOST", value=current)
    rank = hosts.index(current)
    out = base / "output"
    ckpt = base / "checkpoints"
    overrides = [f"hydra.run.dir={environ.get('SM_OUTPUT_DATA_DIR', str(out / 'data'))}/run",
                 f"trainer.export_dir={environ.get('SM_MODEL_DIR', str(base / 'model'))}"]
    notes = [f"SageMaker: host {current} ({rank + 1} of {len(hosts)})"]
    if len(hosts) > 1:
        overrides += ["launcher=torchrun", f"launcher.nnodes={len(hosts)}", f"launcher.node_rank={rank}",
                      f"launcher.master_addr={environ.get('SM_MASTER_ADDR', hosts[0])}",
                      f"launcher.master_port={env_int(environ, 'SM_MASTER_PORT', SAGEMAKER_PORT, lo=1, hi=65535)}",
                      "launcher.shared_run_dir=false"]
    gpus = env_int(environ, "SM_NUM_GPUS", 0, hi=1024)
    if gpus:
        overrides.append(f"launcher.nproc_per_node={gpus}")
    # One prefix in S3 for all instances: each node checkpoints into its own subdirectory of it.
    node_ckpt = ckpt / f"node{rank}" if len(hosts) > 1 else ckpt
    if ckpt.is_dir() or "SM_TRAINING_ENV" in environ:
        overrides.append(f"trainer.checkpoint_dir={node_ckpt}")
        if complete_tags(node_ckpt):
            overrides.append("trainer.resume=true")
            notes.append(f"resuming from {node_ckpt} (a restarted job: SageMaker copied the checkpoints back)")
    user = hp_overrides(hyperparameters(environ, base, argv)) + split_argv(argv)[1]
    given = {_key(o) for o in user}  # the user's value for a key wins
    overrides = [o for o in overrides if _key(o) not in given] + _channels(environ, base, given) + user
    iface = environ.get("SM_NETWORK_INTERFACE_NAME") or resource.get("network_interface_name") or ""
    env = {"NCCL_SOCKET_IFNAME": iface, "GLOO_SOCKET_IFNAME": iface} if iface and len(hosts) > 1 else {}
    return Platform("sagemaker", overrides, env, node_rank=rank, notes=notes)


def failure_file(environ: Mapping[str, str]) -> Optional[Path]:
    """SageMaker shows this file's text as the job's FailureReason (known before anything else is read)."""
    base = _sagemaker_base(environ)
    return base / "output" / "failure" if base is not None else None


def _channels(environ: Mapping[str, str], base: Path, given: set) -> List[str]:
    """Input channels (a directory each) as data.path / data.val_path: the one data file in it."""
    channels = {k[len("SM_CHANNEL_"):].lower(): v for k, v in environ.items() if k.startswith("SM_CHANNEL_")}
    data = base / "input" / "data"
    if data.is_dir():
        channels = {**{d.name: str(d) for d in data.iterdir() if d.is_dir()}, **channels}
    out = []
    for key, names in (("data.path", ("train", "training")), ("data.val_path", ("validation", "test"))):
        name = next((n for n in names if n in channels), None)
        if name is None or key in given:
            continue
        try:
            files = sorted(p for p in Path(channels[name]).iterdir() if p.is_file() and not p.name.startswith("."))
        except (OSError, ValueError) as e:  # ValueError: a path no filesystem takes (a NUL byte)
            raise UserError(f"SageMaker: channel {name} (SM_CHANNEL_{name.upper()}={channels[name]!r}) cannot be read: "
                            f"{getattr(e, 'strerror', None) or e}.",
                            "check the channel's S3 prefix and input mode (File).", key=key,
                            value=channels[name]) from None
        if not files:
            raise UserError(f"SageMaker: channel {name} ({channels[name]}) holds no file at its top level (files in "
                            "subfolders, or Pipe mode?), and zerorun would train on its built-in data instead.",
                            f"upload one .txt/.jsonl/.csv file to the channel's prefix (File input mode), or name it: "
                            f"hyperparameter {key}=<path>.", key=key, value=channels[name])
        if len(files) > 1:
            raise UserError(f"SageMaker: channel {name} holds {len(files)} files ({', '.join(f.name for f in files[:4])}"
                            f"{', ...' if len(files) > 4 else ''}) and zerorun reads one file per split.",
                            f"upload one .txt/.jsonl/.csv file to the channel, or name it: hyperparameter "
                            f"{key}={channels[name]}/<file>.", key=key, value=channels[name])
        if files:
            out.append(f"{key}={files[0]}")
    return out


def write_failure(path: Optional[Path], reason: str) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reason.strip().splitlines()[0][:1000] + "\n")


# ------------------------------------------------------------------------------------------------- Slurm
def expand_nodelist(nodelist: str) -> List[str]:
    """Slurm's compressed host list (``gpu[01-03,07],cpu5``) as host names, in order."""
    hosts = []
    parts = re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist)
    for part in parts:
        m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or not (hi or lo).isdigit():
                raise UserError(f"Slurm node list {nodelist!r}: the range {r!r} is not N or N-M.",
                                "the node list is Slurm's (SLURM_JOB_NODELIST); run zerorun with srun inside the "
                                "allocation.", key="SLURM_JOB_NODELIST", value=nodelist)
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
    return hosts


def _tasks_per_node(environ: Mapping[str, str]) -> int:
    name = "SLURM_STEP_TASKS_PER_NODE" if environ.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    raw = environ.get(name) or "1"
    counts = [int(m.group()) for p in raw.split(",") if (m := re.match(r"\d+", p))]  # "2(x3),1"
    if not counts:
        raise UserError(f"{name}={raw!r} in the environment: expected task counts such as 1 or 2(x3),1.",
                        "this variable is Slurm's: run zerorun with srun inside the allocation.", key=name, value=raw)
    return max(counts)


def slurm(environ: Mapping[str, str]) -> Platform:
    job = environ["SLURM_JOB_ID"]
    # Only an srun step spans nodes; zerorun run by the batch script itself is one node's job.
    in_step = bool(environ.get("SLURM_STEP_ID"))
    tasks = _tasks_per_node(environ) if in_step else 1
    if tasks > 1:
        raise UserError(f"Slurm started {tasks} tasks on this node (SLURM_STEP_TASKS_PER_NODE), and each would "
                        f"start this node's ranks: {tasks}× too many ranks.",
                        "srun --ntasks-per-node=1 zerorun ... (zerorun starts one rank per GPU itself).",
                        key="SLURM_STEP_TASKS_PER_NODE", value=tasks)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
    hosts = expand_nodelist(nodelist) if nodelist else []
    nodes_var = "SLURM_STEP_NUM_NODES" if environ.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    nnodes = env_int(environ, nodes_var, len(hosts) or 1, lo=1) if in_step else 1
    rank = env_int(environ, "SLURM_NODEID", 0, hi=max(0, nnodes - 1)) if in_step else 0
    name = environ.get("SLURM_JOB_NAME", "zerorun")
    root = Path(environ.get("ZERORUN_RUN_ROOT") or Path(environ.get("SLURM_SUBMIT_DIR") or ".") / "zerorun-runs")
    # One run dir per srun step of the job: a requeued job (same id, steps counted from 0 again) finds its
    # own; two `srun zerorun` in one allocation do not share one.
    run_dir = root / f"{name}-{job}-{environ.get('SLURM_STEP_ID') or 'batch'}"
    overrides = [f"hydra.run.dir={run_dir}"]
    if nnodes > 1:
        if not hosts:
            raise UserError("Slurm: SLURM_JOB_NODELIST is empty, so node 0's address is unknown.",
                            "run zerorun with srun inside the allocation.", key="SLURM_JOB_NODELIST")
        overrides += ["launcher=torchrun", f"launcher.nnodes={nnodes}", f"launcher.node_rank={rank}",
                      f"launcher.master_addr={hosts[0]}", f"launcher.master_port={20000 + env_int(environ, 'SLURM_JOB_ID', 0) % 20000}"]
    notes = [f"Slurm job {job}: node {rank} of {nnodes}" + (f", master {hosts[0]}" if nnodes > 1 else "")]
    if env_int(environ, "SLURM_RESTART_COUNT", 0) > 0 and complete_tags(run_dir / "checkpoints"):
        overrides.append("trainer.resume=true")
        notes.append(f"resuming from {run_dir / 'checkpoints'} (requeued: SLURM_RESTART_COUNT="
                     f"{environ['SLURM_RESTART_COUNT']})")
    return Platform("slurm", overrides, requeue=["scontrol", "requeue", job], node_rank=rank, notes=notes)

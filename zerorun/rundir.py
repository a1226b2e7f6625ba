"""The run directory: the contract between the launcher and the ranks, and what a run leaves behind.

The launcher writes the resolved inputs once (atomically: with a shared run dir every node's zerorun
writes the same files, and a rank must never read a half-written one); ranks read only these and
write their outputs here. This module names every file and is the only one that reads or writes them
(checkpoints/ belongs to zerorun.checkpoint, export/ to the exporter, nvme_swap/ to DeepSpeed).

  config.yaml      the resolved RunConfig (after autofit; offload.nvme_path filled in)
  plan.json        the Plan (batch geometry, task, buckets, offload, optimizer) the launcher computed
  ds_config.json   the DeepSpeed JSON rendered from both
  estimate.json    the memory estimate and the gate's decision
  prepared.json    where the tokenized data lives (zerorun.data.Prepared)
  resume.json      the checkpoint to resume from, when resuming
  command.sh       the exact command that started the ranks
  metrics.jsonl    one JSON object per optimizer step (rank 0)
  summary.json     the outcome: written last, by rank 0; its presence means the run completed
  recoveries.json  every OOM recovery, preemption and restart (the launcher's, zerorun.supervise), with the
                   config changes a later resume of this run applies again
  faults/, STOP    a rank's record of why it stopped, the launcher's stop request (zerorun.faults)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

CONFIG, PLAN, DS_CONFIG, ESTIMATE = "config.yaml", "plan.json", "ds_config.json", "estimate.json"
PREPARED, RESUME, COMMAND = "prepared.json", "resume.json", "command.sh"
METRICS, SUMMARY, RECOVERIES = "metrics.jsonl", "summary.json", "recoveries.json"
CHECKPOINTS, EXPORT, NVME_SWAP = "checkpoints", "export", "nvme_swap"


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename: readers see the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def export(self) -> Path:
        return self.path / EXPORT

    def checkpoints_for(self, cfg) -> Path:
        """trainer.checkpoint_dir when set (SageMaker's synced /opt/ml/checkpoints), else checkpoints/ here."""
        return Path(cfg.trainer.checkpoint_dir) if cfg.trainer.checkpoint_dir else self.checkpoints

    def export_for(self, cfg) -> Path:
        return Path(cfg.trainer.export_dir) if cfg.trainer.export_dir else self.export

    @property
    def default_nvme_path(self) -> str:
        return str(self.path / NVME_SWAP)

    # ------------------------------------------------------------------ launcher side
    def write_inputs(self, *, config_yaml: str, plan: Dict[str, Any], ds_config: Dict[str, Any],
                     estimate: Dict[str, Any], prepared: Dict[str, Any], resume: Optional[Dict[str, Any]]) -> None:
        """Everything the ranks read, written before they start."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.file(CONFIG), config_yaml)
        write_atomic(self.file(PLAN), _json(plan))
        write_atomic(self.file(DS_CONFIG), _json(ds_config))
        write_atomic(self.file(ESTIMATE), _json(estimate))
        write_atomic(self.file(PREPARED), _json(prepared))
        if resume:
            write_atomic(self.file(RESUME), _json(resume))
        elif self.file(RESUME).exists():
            self.file(RESUME).unlink()

    def write_command(self, line: str) -> None:
        write_atomic(self.file(COMMAND), "#!/usr/bin/env bash\n" + line + "\n")

    def clear_outcome(self) -> None:
        """Before a launch: a summary left by an earlier run must not pass for this one's."""
        if self.file(SUMMARY).exists():
            self.file(SUMMARY).unlink()

    # ------------------------------------------------------------------ rank side (inputs)
    def read_config(self):
        from omegaconf import OmegaConf

        from .config import to_run_config

        return to_run_config(OmegaConf.load(self.file(CONFIG)))

    def read_plan(self):
        from .config import Plan

        return Plan.from_json(self.read_json(PLAN))

    def read_ds_config(self) -> Dict[str, Any]:
        return self.read_json(DS_CONFIG)

    def read_prepared(self):
        from .data import Prepared

        return Prepared.from_json(self.read_json(PREPARED))

    def read_resume(self) -> Optional[Dict[str, Any]]:
        return self.read_json(RESUME) if self.file(RESUME).exists() else None

    def read_estimate(self) -> Optional[Dict[str, Any]]:
        return self.read_json(ESTIMATE) if self.file(ESTIMATE).exists() else None

    def read_json(self, name: str) -> Any:
        return json.loads(self.file(name).read_text())

    # ------------------------------------------------------------------ rank side (outputs)
    def start_metrics(self, keep_through_step: int) -> None:
        """A fresh run starts a new metrics file; a resumed one drops the steps it will redo, so every
        step appears exactly once."""
        kept = [r for r in self.read_metrics() if r["step"] <= keep_through_step]
        write_atomic(self.file(METRICS), "".join(json.dumps(r) + "\n" for r in kept))

    def append_metrics(self, records: Iterable[Dict[str, Any]]) -> None:
        with self.file(METRICS).open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))

    def read_metrics(self) -> List[Dict[str, Any]]:
        if not self.file(METRICS).exists():
            return []
        out = []
        for line in self.file(METRICS).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a rank killed mid-append leaves a torn last line: those steps are redone
                break
        return out

    def write_summary(self, summary: Dict[str, Any]) -> None:
        write_atomic(self.file(SUMMARY), _json(summary))

    def read_summary(self) -> Optional[Dict[str, Any]]:
        try:
            return self.read_json(SUMMARY) if self.file(SUMMARY).exists() else None
        except ValueError:
            return None

    # ------------------------------------------------------------------ launcher side (recoveries)
    def read_recoveries(self) -> List[Dict[str, Any]]:
        return self.read_json(RECOVERIES) if self.file(RECOVERIES).exists() else []

    def append_recovery(self, event: Dict[str, Any]) -> None:
        write_atomic(self.file(RECOVERIES), _json(self.read_recoveries() + [event]))

"""Third-party chatter off the terminal unless ``verbose=true``: the terminal shows zerorun's own lines and the
progress bar. transformers' and DeepSpeed's loggers print WARNING and above (their INFO goes to the run dir's
``libraries.log`` in the ranks), the deepspeed CLI runs with ``--log_level=error`` (its ``[INFO]`` lines about
the world it spawns; "no hostfile" is a WARNING), what DeepSpeed prints while it sets up its communication op
is dropped, and DeepSpeed's "Attempting to get learning rate from scheduler before it has started"
(logged whenever the LR is read before the first step) is dropped."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

LIBRARY_LOG = "libraries.log"
"""In the run dir: the ranks' transformers and DeepSpeed INFO lines, which the terminal leaves out."""
NOISE = ("Attempting to get learning rate from scheduler before it has started",)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in NOISE)


def launcher_argv(argv: List[str], verbose: bool) -> List[str]:
    """The launch command with the deepspeed CLI's own logging at ERROR (unless verbose); others unchanged."""
    if verbose or not argv or Path(argv[0]).name != "deepspeed" or any(a.startswith("--log_level") for a in argv):
        return list(argv)
    return [argv[0], "--log_level=error", *argv[1:]]


def library_stdout(verbose: bool):
    """A context in which what a library prints to stdout is dropped (unless verbose)."""
    import contextlib
    import io

    return contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())


def library_loggers() -> List[logging.Logger]:
    """transformers' and DeepSpeed's root loggers (those already imported; importing them is the caller's)."""
    out = [logging.getLogger("transformers"), logging.getLogger("matplotlib"),  # (its font cache: zerorun-report)
           logging.getLogger("py.warnings")]  # libraries' Python warnings (deprecations, peft's notes)
    if "deepspeed" in sys.modules:
        from deepspeed.utils import logger as ds_logger

        out.append(ds_logger)
    return out


def quiet_libraries(verbose: bool, log_file: Optional[Path] = None) -> None:
    """Terminal handlers of transformers and DeepSpeed at WARNING (INFO with ``verbose``), the known noise
    filtered; with ``log_file``, everything from INFO up is written there too."""
    level = logging.INFO if verbose else logging.WARNING
    logging.captureWarnings(True)
    warnings_logger = logging.getLogger("py.warnings")
    warnings_logger.propagate = verbose  # the terminal sees them only with verbose; the run dir's log always
    if not warnings_logger.handlers:
        warnings_logger.addHandler(logging.NullHandler())
    for lg in library_loggers():
        lg.setLevel(logging.INFO if (verbose or log_file) else logging.WARNING)
        for h in lg.handlers:
            if not isinstance(h, logging.FileHandler):
                h.setLevel(level)
                if not verbose:
                    h.addFilter(_DropNoise())
        if lg.name == "transformers":
            tf_level = logging.INFO if (verbose or log_file) else logging.WARNING
            if "transformers" in sys.modules:
                from transformers.utils import logging as tf_logging

                tf_logging.set_verbosity(tf_level)
                for h in lg.handlers:  # set_verbosity leaves handler levels alone
                    h.setLevel(level)
            else:
                # Not imported yet (the CLI, which may never need it): transformers reads this variable when it
                # configures its root logger on import. Importing it only to set a level costs seconds.
                os.environ["TRANSFORMERS_VERBOSITY"] = logging.getLevelName(tf_level).lower()
        if log_file is not None and not any(isinstance(h, logging.FileHandler) for h in lg.handlers):
            fh = logging.FileHandler(log_file)
            fh.setLevel(logging.INFO)
            fh.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
            lg.addHandler(fh)

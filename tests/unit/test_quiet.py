"""Third-party chatter off the terminal by default (zerorun.quiet); verbose=true shows it all."""
import logging

import pytest

from helpers import composed
from zerorun import quiet


@pytest.mark.heavy
def test_the_deepspeed_cli_logs_errors_only_unless_verbose():
    argv = ["/venv/bin/deepspeed", "--num_gpus", "2", "--module", "zerorun.train", "/r"]
    assert quiet.launcher_argv(argv, verbose=False) == [argv[0], "--log_level=error", *argv[1:]]
    assert quiet.launcher_argv(argv, verbose=True) == argv
    torchrun = ["/venv/bin/torchrun", "--nproc_per_node", "2"]
    assert quiet.launcher_argv(torchrun, verbose=False) == torchrun
    assert composed().verbose is False and composed("verbose=true").verbose is True


@pytest.mark.heavy
def test_library_info_and_the_lr_noise_stay_off_the_terminal_and_info_goes_to_the_log(tmp_path):
    import io

    import deepspeed  # noqa: F401 (its logger exists once imported, as in a rank)
    from deepspeed.utils import logger as ds

    stream = io.StringIO()
    terminal = logging.StreamHandler(stream)
    ds.addHandler(terminal)
    saved = (ds.level, [(h, h.level, list(h.filters)) for h in ds.handlers])
    try:
        quiet.quiet_libraries(False, tmp_path / quiet.LIBRARY_LOG)
        ds.info("engine config dump")
        ds.warning("Attempting to get learning rate from scheduler before it has started")
        ds.warning("a real warning")
        assert stream.getvalue() == "a real warning\n"
        for h in ds.handlers:
            h.flush()
        assert "engine config dump" in (tmp_path / quiet.LIBRARY_LOG).read_text()
        assert logging.getLogger("transformers").getEffectiveLevel() <= logging.INFO  # to the log file only
        assert all(h.level >= logging.WARNING for h in logging.getLogger("transformers").handlers
                   if not isinstance(h, logging.FileHandler))
    finally:
        ds.level = saved[0]
        for h in list(ds.handlers):
            if isinstance(h, logging.FileHandler) or h is terminal:
                ds.removeHandler(h)
                h.close()
        for h, level, filters in saved[1]:
            h.setLevel(level)
            h.filters[:] = filters
        for h in list(logging.getLogger("transformers").handlers):
            if isinstance(h, logging.FileHandler):
                logging.getLogger("transformers").removeHandler(h)
                h.close()


@pytest.mark.heavy
def test_a_healthy_loss_type_warning_is_gone():
    from zerorun.config import TaskName
    from zerorun.models import build_model

    model = build_model(composed().model, TaskName.causal_lm, 2)
    assert model.loss_type == "ForCausalLM"

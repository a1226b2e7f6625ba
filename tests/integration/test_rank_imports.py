"""What a fresh process imports to plan a LoRA run and to become a rank: neither pays for libraries it never runs
(peft's import in the planner; scikit-learn and SciPy, which transformers imports whenever installed, in a rank)."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROBE = """
import sys
from zerorun.config import compose
from zerorun.arch import lora_target_problems
cfg = compose(["+model=qwen3-8b", "adapter=lora"])
assert lora_target_problems(cfg.model, cfg.adapter) == []
print("planner imported peft:", "peft" in sys.modules)
from zerorun.models import import_model_code
import_model_code("llama")
from transformers.utils import is_scipy_available, is_sklearn_available
print("rank imported:", sorted(m for m in ("sklearn", "scipy") if m in sys.modules),
      "transformers sees:", is_sklearn_available(), is_scipy_available())
"""


def test_a_lora_plan_imports_no_peft_and_a_rank_no_sklearn_or_scipy():
    import importlib.util

    assert importlib.util.find_spec("sklearn") and importlib.util.find_spec("scipy")  # installed: the case at hand
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "planner imported peft: False" in out.stdout, out.stdout
    assert "rank imported: [] transformers sees: False False" in out.stdout, out.stdout

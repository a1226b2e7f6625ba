"""Rank side: ``python -m zerorun.train RUN_DIR`` (started by deepspeed or torchrun on every rank).

Reads only the run dir the launcher wrote (never Hydra's argv), so what was launched is exactly what
trains. run.py: a rank's life; trainer.py: the loop; strategy.py: data parallel vs pipeline;
export.py: the Hugging Face export.
"""

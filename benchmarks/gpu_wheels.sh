#!/usr/bin/env bash
# The wheels benchmarks/gpu_session.sh installs on a borrowed GPU machine (its image has CUDA torch, numpy,
# safetensors, sentencepiece, protobuf, matplotlib ... but not these, or not these versions), into .whl/ (keep it out
# of git: `echo /.whl/ >> .git/info/exclude`). ~22 MB. Run here, from the repository root, with the project's venv.
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
# Python 3.12 on the GPU image; binary wheels for it, pure ones as they are.
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  hydra-core==1.3.8 omegaconf==2.3.1 hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types \
  typing-inspection transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2 accelerate==1.11.0 peft==0.21.2
# Source-only on PyPI: built here as pure wheels (DeepSpeed without prebuilt ops: zerorun builds them there).
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w .whl antlr4-python3-runtime==4.9.3 deepspeed==0.19.8
$PY -m pip wheel -q --no-deps --no-build-isolation -w .whl .
rm -rf build
du -sh .whl

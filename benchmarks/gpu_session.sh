#!/usr/bin/env bash
# One lease of a GPU machine, as one prepared script (device time is scarce): the packages zerorun needs that the
# machine's image lacks (carried as wheels in .whl/), DeepSpeed's CUDA ops built the way zerorun builds them, then
# in order of importance: a real `zerorun` run on the GPU with nvidia-smi sampled beside it, the GPU memory
# validator (make gpu-validate's script) on a subset of its matrix, and the paired throughput benchmark on CUDA.
# The wheels: `bash benchmarks/gpu_wheels.sh` here, before the lease (carry .whl). Each stage has its own time
# limit, so one stage's failure leaves the others' figures. Output: $OUT.
#   bash benchmarks/gpu_session.sh          # on the GPU machine, from the repository root
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
T0=$(date +%s)
stage() { echo; echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
exec > >(tee -a "$OUT/session.log") 2>&1

stage "install carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 MAX_JOBS=16
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}"
python3 -c "import torch, deepspeed, transformers, peft, zerorun; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, torch.cuda.is_available(), '| deepspeed', deepspeed.__version__, '| transformers', \
transformers.__version__, '| nvcc', __import__('shutil').which('nvcc'))"

stage "DeepSpeed's CUDA ops (python -m zerorun.prebuild fused_adam cpu_adam), timed"
time timeout 150 python3 -m zerorun.prebuild fused_adam cpu_adam

stage "zerorun on the GPU: qwen2.5-0.5b bf16 ZeRO-2, seq 1024, micro 8; nvidia-smi sampled every 100 ms"
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/smi.csv" &
SMI=$!
timeout 90 zerorun +model=qwen2.5-0.5b precision=bf16 zero=stage2 data.seq_len=1024 trainer.micro_batch_size=8 \
  trainer.max_steps=40 trainer.export=false trainer.progress=false hydra.run.dir=/tmp/run1
echo "zerorun exit code: $?"
kill $SMI
echo "nvidia-smi memory.used max: $(cut -d, -f2 "$OUT/smi.csv" | sort -n | tail -1) MiB"
cp /tmp/run1/summary.json "$OUT/run1-summary.json" 2>/dev/null
cp /tmp/run1/estimate.json "$OUT/run1-estimate.json" 2>/dev/null

# The first lease (2026-11-27, docs/memory.md §8.5) measured GPT-2 × ZeRO 0/2/3 (offload with ZeRO-2) and BERT-base
# ZeRO-0 (benchmarks/results/gpu/): this one starts with what it did not reach, a Llama-class model and ZeRO-3 with
# offload, which test the measured terms on cases they were not set from.
stage "GPU memory validator: qwen2.5-0.5b × bf16 × ZeRO 0/2/3 × offload none/cpu; gpt2 ZeRO-3 with offload"
timeout 150 python3 benchmarks/validate_memory_gpu.py --models qwen2.5-0.5b --dtypes bf16 --zero 0,2,3 --warmup 2 \
  --steps 2 --json "$OUT/gpu-validation-qwen.json"
timeout 40 python3 benchmarks/validate_memory_gpu.py --models gpt2 --dtypes bf16 --zero 3 --offload cpu \
  --warmup 2 --steps 2 --json "$OUT/gpu-validation-gpt2-z3-offload.json"
# A traced family (zerorun/arch/traced.py: planned from the model transformers builds) on CUDA's kernels
timeout 60 python3 benchmarks/validate_memory_gpu.py --models gemma-3-1b --dtypes bf16 --zero 2 --offload none \
  --seqs 512 --warmup 2 --steps 2 --json "$OUT/gpu-validation-gemma3.json"
python3 benchmarks/validate_memory_gpu.py --rescore "$OUT"/gpu-validation-*.json | tail -9

stage "throughput on the GPU: zerorun (defaults, and without each of its GPU settings) against the loop"
timeout 200 python3 benchmarks/throughput.py --gpus 1 --spec gpt2 --dtype bf16 --pairs 1 --steps 60 --warmup 10 \
  --systems zerorun,zerorun@fixed-segments,zerorun@ds-buckets,loop
stage "done"

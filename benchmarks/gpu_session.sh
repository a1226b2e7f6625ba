#!/usr/bin/env bash
# One lease of a GPU machine, as one prepared script (device time is scarce): the packages zerorun needs that the
# machine's image lacks (carried as wheels in .whl/), DeepSpeed's CUDA ops built the way zerorun builds them, then
# in order of importance the measurements the earlier leases did not reach (docs/memory.md §8.5). Every stage's
# time limit is cut to what is left of DEADLINE (seconds), so a slow stage costs the later ones, never the run:
# what a stage measured is in $OUT as soon as it ends.
# The wheels: `bash benchmarks/gpu_wheels.sh` here, before the lease (carry .whl). For the allocator stage, a
# tcmalloc built for x86-64 glibc in .whl/lib (`cp -L /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 .whl/lib`).
#   DEADLINE=480 bash benchmarks/gpu_session.sh      # on the GPU machine, from the repository root
set -u
OUT=${OUT:-/tmp/gpu-session}
DEADLINE=${DEADLINE:-480}
mkdir -p "$OUT"
T0=$(date +%s)
stage() { echo; echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
# limit CAP: CAP seconds, or what is left before DEADLINE less 15 s for the closing stage (0: skip the stage)
limit() { local left=$(( DEADLINE - ($(date +%s) - T0) - 15 )); (( left < $1 )) && echo $(( left > 20 ? left : 0 )) \
  || echo "$1"; }
run_for() { local t; t=$(limit "$1"); shift; if (( t == 0 )); then echo "skipped: no time left"; return; fi
  timeout "$t" "$@"; echo "exit code $? (limit ${t} s)"; }
exec > >(tee -a "$OUT/session.log") 2>&1

stage "install carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 MAX_JOBS=16
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, deepspeed, transformers, peft, zerorun; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, torch.cuda.is_available(), '| deepspeed', deepspeed.__version__, '| transformers', \
transformers.__version__)"

stage "DeepSpeed's FusedAdam (python -m zerorun.prebuild fused_adam); cpu_adam builds beside the next stages"
time run_for 120 python3 -m zerorun.prebuild fused_adam
( timeout 200 python3 -m zerorun.prebuild cpu_adam > "$OUT/cpu_adam.log" 2>&1; echo "cpu_adam exit $?" \
  >> "$OUT/cpu_adam.log" ) &
CPU_ADAM=$!

# 1. GPT-2 with the fused GeLU (§3.4): the first lease measured transformers' gelu_new, which saves 4 MLP-wide tensors
stage "validator: gpt2 bf16 × ZeRO 0/2/3 × checkpointing off/on × seq 128/512 (fused GeLU)"
run_for 130 python3 benchmarks/validate_memory_gpu.py --models gpt2 --dtypes bf16 --zero 0,2,3 --offload none \
  --warmup 2 --steps 2 --json "$OUT/gpu-validation-gpt2.json"
# 2. A Llama-class decoder (GQA, RoPE, SwiGLU, 152k vocabulary), never measured on CUDA
stage "validator: qwen2.5-0.5b bf16 × ZeRO 0/2/3 × checkpointing off/on, seq 512"
run_for 110 python3 benchmarks/validate_memory_gpu.py --models qwen2.5-0.5b --dtypes bf16 --zero 0,2,3 \
  --offload none --seqs 512 --warmup 2 --steps 2 --json "$OUT/gpu-validation-qwen.json"
# 3. Held out: a shape none of the terms were set from, through zerorun's own launcher, nvidia-smi beside it
stage "zerorun: qwen2.5-0.5b bf16 ZeRO-2 seq 1024 micro 8; nvidia-smi every 100 ms"
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/smi.csv" &
SMI=$!
run_for 80 zerorun +model=qwen2.5-0.5b precision=bf16 zero=stage2 data.seq_len=1024 trainer.micro_batch_size=8 \
  trainer.max_steps=30 trainer.export=false trainer.progress=false hydra.run.dir=/tmp/run1
kill $SMI
echo "nvidia-smi memory.used max: $(cut -d, -f2 "$OUT/smi.csv" | sort -n | tail -1) MiB"
cp /tmp/run1/summary.json "$OUT/run1-summary.json" 2>/dev/null
cp /tmp/run1/estimate.json "$OUT/run1-estimate.json" 2>/dev/null
# 4. ZeRO with CPU offload (DeepSpeedCPUAdam), never measured for ZeRO-3
stage "validator: gpt2 bf16 × ZeRO 2/3 with CPU offload, seq 512"
wait $CPU_ADAM; tail -3 "$OUT/cpu_adam.log"
run_for 90 python3 benchmarks/validate_memory_gpu.py --models gpt2 --dtypes bf16 --zero 2,3 --offload cpu \
  --seqs 512 --warmup 2 --steps 2 --json "$OUT/gpu-validation-gpt2-offload.json"
# 5. #33: the host side of CPU offload on glibc (GPU ranks' default) against tcmalloc; tokens/s and VmHWM
stage "throughput, GPU rank with CPU offload: glibc (default) against tcmalloc"
export ZERORUN_ALLOCATOR_DIRS=$PWD/.whl/lib
run_for 120 python3 benchmarks/throughput.py --gpus 1 --spec gpt2 --dtype bf16 \
  --zero 2 --offload cpu --pairs 1 --steps 30 --warmup 5 --systems zerorun,zerorun@tcmalloc

stage "the rows against today's estimator"
python3 benchmarks/validate_memory_gpu.py --rescore "$OUT"/gpu-validation-*.json | tail -12
stage "done"

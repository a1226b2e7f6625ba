#!/usr/bin/env bash
# One lease of a GPU machine, as one prepared script (device time is scarce): the packages zerorun needs that the
# machine's image lacks (carried as wheels in .whl/), DeepSpeed's CUDA ops built the way zerorun builds them, then
# in order of importance the measurements the earlier leases did not reach (docs/memory.md §8.5-8.6, docs/speed.md).
# Every stage's
# time limit is cut to what is left of DEADLINE (seconds), so a slow stage costs the later ones, never the run:
# what a stage measured is in $OUT as soon as it ends. The wheels: `bash benchmarks/gpu_wheels.sh` here, before the
# lease (carry .whl).
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

# Both before the throughput stage: a compile beside it would take the cores its ranks' host side runs on
stage "DeepSpeed's FusedAdam and CPU Adam, side by side (python -m zerorun.prebuild fused_adam cpu_adam)"
time run_for 120 python3 -m zerorun.prebuild fused_adam cpu_adam

# What the leases so far left open (docs/memory.md §8.5-8.7, docs/speed.md), most important first.
# 1. Held out for the ZeRO-3 prefetch rule set from the third lease (§8.7: the front fills stage3_max_live_parameters):
#    a model over 1e9 parameters at ZeRO-3 through zerorun's launcher; summary.json has the device and host peaks
stage "zerorun: llama-3.2-1b bf16 ZeRO-3 + CPU offload (parameters too), seq 2048 micro 4, checkpointing; nvidia-smi"
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/smi.csv" &
SMI=$!
run_for 120 zerorun +model=llama-3.2-1b precision=bf16 zero=stage3 offload=cpu data.seq_len=2048 trainer.micro_batch_size=4 \
  trainer.activation_checkpointing=true trainer.max_steps=12 trainer.export=false trainer.progress=false \
  hydra.run.dir=/tmp/run1
kill $SMI
echo "nvidia-smi memory.used max: $(cut -d, -f2 "$OUT/smi.csv" | sort -n | tail -1) MiB"
cp /tmp/run1/summary.json "$OUT/run1-summary.json" 2>/dev/null
cp /tmp/run1/estimate.json "$OUT/run1-estimate.json" 2>/dev/null
# 2. zerorun against the hand-written loop: 1.28x and 1.12x in the third lease (one round each); a third and fourth
stage "throughput on the GPU: zerorun's defaults and the hand-written loop, two rounds"
run_for 200 python3 benchmarks/throughput.py --gpus 1 --spec gpt2 --dtype bf16 --pairs 2 --steps 60 --warmup 10 \
  --systems zerorun,loop
# 3. The validator on a shape no lease measured: Qwen2.5-0.5B ZeRO-3 with the parameters offloaded, seq 1024
stage "validator: qwen2.5-0.5b bf16 ZeRO-3, parameters offloaded, seq 1024"
run_for 150 python3 benchmarks/validate_memory_gpu.py --models qwen2.5-0.5b --dtypes bf16 --zero 3 --offload cpu \
  --seqs 1024 --warmup 2 --steps 2 --json "$OUT/gpu-validation-qwen-z3-offload.json"

stage "the rows against today's estimator"
python3 benchmarks/validate_memory_gpu.py --rescore "$OUT"/gpu-validation-*.json | tail -12
stage "done"

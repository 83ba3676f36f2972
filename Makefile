# The two commands of the README: `make lab` (open the course) and `make test` (run every test).
PY := .venv/bin/python

.PHONY: setup lab test labs bench grade gpu-check clean

setup:
	@bash tools/setup_env.sh

lab: setup
	$(PY) -m jupyterlab chapters/00_the_stack.ipynb

test: setup
	$(PY) -m pytest

labs: setup
	$(PY) tools/make_labs.py

bench: setup
	$(PY) -m nanoserve bench

# On a machine with CUDA: gpu tests and GPU benchmarks, under 8 minutes, into benchmarks/results/gpu-<time>/
gpu-check: setup
	$(PY) tools/gpu_check.py

clean:
	rm -rf .venv .pytest_cache

# Grade a learner's lab: make grade NB=labs/lab03_data_pipeline.ipynb
grade: setup
	$(PY) -m nanoserve.course.grade $(NB)

# The two commands of the README: `make lab` (open the course) and `make test` (run every test).
PY := .venv/bin/python

.PHONY: setup lab test unit labs bench grade gpu-check clean

setup:
	@bash tools/setup_env.sh

# Serves the repository root (chapters/, labs/, solutions/, README in the file browser) and opens
# chapter 00. As root (the usual user in GPU containers) JupyterLab needs --allow-root.
lab: setup
	$(PY) -m jupyterlab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/chapters/00_the_stack.ipynb \
		$(if $(filter 0,$(shell id -u)),--allow-root)

# Every test in one pytest run, one test at a time: the notebooks measure this machine.
test: setup
	$(PY) -m pytest

# The quick check while working: the engine's unit tests (no notebook, no kernel) on two pytest-xdist workers,
# each taking whole files so a file's tests run in their order.
unit: setup
	$(PY) -m pytest tests --ignore=tests/course --ignore=tests/fixtures -n 2 --dist loadfile

labs: setup
	$(PY) tools/make_labs.py

bench: setup
	$(PY) -m nanoserve bench

# On a machine with CUDA: gpu tests and GPU benchmarks, under 9.5 minutes, into benchmarks/results/gpu-<time>/
gpu-check: setup
	$(PY) tools/gpu_check.py

clean:
	rm -rf .venv .pytest_cache

# Grade a learner's lab: make grade NB=labs/lab03_data_pipeline.ipynb
grade: setup
	$(PY) -m nanoserve.course.grade $(NB)

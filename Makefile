# The two commands of the README: `make lab` (open the course) and `make test` (run every test).
PY := .venv/bin/python

.PHONY: setup lab test test-cpu known-cpu unit notebooks labs student bench grade gpu-check clean

setup:
	@bash tools/setup_env.sh

# Serves the repository root (chapters/, labs/, solutions/, README in the file browser) and opens
# chapter 00. As root (the usual user in GPU containers) JupyterLab needs --allow-root.
lab: setup
	$(PY) -m jupyterlab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/chapters/00_the_stack.ipynb \
		$(if $(filter 0,$(shell id -u)),--allow-root)

# Every test, in two pytest runs, one after the other. First the unit tests (the engine's, the course tooling's,
# the exercises'): they check correctness, not speed, and most of their time is one busy thread (starting
# processes and kernels, importing torch), so two pytest-xdist workers share the cores, each taking whole files
# (a file's tests run in their order, as in one process), the heaviest first (conftest.py). Then what measures
# this machine, one at a time with nothing beside it: the third-party load clients against our server (guidellm
# and aiperf, four busy processes whose timings are compared with ours), the busy fraction beside competing
# processes, the notebooks, and with them the labs' tests that read nbval's run of each solution.
LAB_TESTS := tests/course/test_lab[0-9]*.py
TIMED := tests/serve/test_clients.py tests/perf/test_busy_under_load.py
UNIT := -m pytest tests --ignore=tests/fixtures --ignore-glob='$(LAB_TESTS)' $(addprefix --ignore=,$(TIMED)) -n 2 --dist loadfile --no-loadscope-reorder
# (wildcard: the student bundle, `make student`, has no solutions/ and no lab tests; its `make test` runs the rest)
NOTEBOOKS := -m pytest $(TIMED) $(wildcard $(LAB_TESTS) tests/fixtures) chapters $(wildcard solutions)

test: setup
	$(PY) $(UNIT)
	$(PY) $(NOTEBOOKS)

# The whole test command as another x86 CPU runs it, on a machine that has more: `make test-cpu CPU=avx2` (an
# AVX2-only CPU: no AVX-512, no BF16 or VNNI units, a Zen 2 EPYC's set) or `CPU=avx512-vnni` (AVX-512 and VNNI, no
# BF16 units: a Cascade Lake or Ice Lake Xeon's). oneDNN and MKL are held to that set, and for avx2 PyTorch's own
# kernels too; inductor compiles into a cache of its own (its cache does not tell instruction sets apart: code
# compiled under one, loaded under the other, computes garbage). It emulates the instruction set, not the other
# chip's caches, clocks or memory.
CPU_avx2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
CPU_avx512-vnni := ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI
HELD = $(CPU_$(CPU)) TORCHINDUCTOR_CACHE_DIR="$(CURDIR)/.cache/inductor-$(CPU)"

test-cpu: known-cpu setup
	$(HELD) $(PY) $(UNIT)
	$(HELD) $(PY) $(NOTEBOOKS)

known-cpu:   # before setup: a mistyped CPU= is told at once, not after the install
	@$(if $(CPU_$(CPU)),true,$(error CPU=$(CPU): expected avx2 or avx512-vnni))

# The quick check while working: the unit tests alone (about four minutes); `make notebooks` runs the rest.
unit: setup
	$(PY) $(UNIT)

notebooks: setup
	$(PY) $(NOTEBOOKS)

labs: setup
	$(PY) tools/make_labs.py

# The learner's copy of the course, without solutions: dist/nanoserve-student/ and dist/nanoserve-student.zip
student: setup
	$(PY) tools/make_student.py

bench: setup
	$(PY) -m nanoserve bench

# On a machine with CUDA: gpu tests and GPU benchmarks, under 9.5 minutes, into benchmarks/results/gpu-<time>/
gpu-check: setup
	$(PY) tools/gpu_check.py

clean:
	rm -rf .venv .pytest_cache

# Grade a learner's lab: make grade NB=labs/lab03_data_pipeline.ipynb; a class: make grade NB=submissions/ (grades.csv)
grade: setup
	$(PY) -m nanoserve.course.grade $(NB)

# The two commands of the README: `make lab` (open the course) and `make test` (run every test).
PY := .venv/bin/python

.PHONY: setup lab test labs bench grade clean

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

clean:
	rm -rf .venv .pytest_cache

# Grade a learner's lab: make grade NB=labs/lab03_data_pipeline.ipynb
grade: setup
	$(PY) -m nanoserve.course.grade $(NB)

"""The course's shipped items for lm-eval (the task YAMLs' `custom_dataset`): read from the JSON lines beside this
file, so lm-eval downloads nothing and `datasets` caches nothing. The items are written by
`python -m nanoserve.course.evals`."""
import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _test_split(name: str) -> dict:
    rows = [json.loads(s) for s in (HERE / f"{name}.jsonl").read_text().splitlines()]
    return {"test": datasets.Dataset.from_list(rows)}


def line_mc(**_model_args):   # lm-eval passes its metadata and model arguments: not needed here
    return _test_split("course_line_mc")


def line_gen(**_model_args):
    return _test_split("course_line_gen")

"""The models the project ships: the course model's directories and the published configs of real-shape models.

    COURSE_MODEL, COURSE_DRAFT_MODEL     # Hugging Face-format directories, trained by tools/train_course_model.py
    real_shape_configs()                 # ["llama-3.2-1b", "qwen2.5-0.5b", "smollm2-135m"]
    config_path("qwen2.5-0.5b")          # .../models/configs/qwen2.5-0.5b.json, as its publisher ships it

Paths only: `nanoserve` and `nanoserve.llm` both read COURSE_MODEL from here, so neither imports the other.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent
COURSE_MODEL = str(_PACKAGE / "course_models" / "base")         # the shipped course model (Hugging Face format)
COURSE_DRAFT_MODEL = str(_PACKAGE / "course_models" / "draft")  # its much smaller sibling, the draft for speculation
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


def real_shape_configs() -> list[str]:
    """Names of the shipped public configs (models/configs/<name>.json), sorted."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def config_path(name: str) -> Path:
    """The shipped config.json of the public model `name` (one of `real_shape_configs()`)."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no shipped config named {name!r}: expected one of {', '.join(real_shape_configs())}")
    return path

"""nanoserve: a small LLM inference engine, built one chapter at a time.

    from nanoserve import LLM, SamplingParams, COURSE_MODEL
"""
from pathlib import Path

from nanoserve import perf
from nanoserve.llm import LLM, CompletionOutput, RequestOutput
from nanoserve.sampling import SamplingParams

__version__ = "0.1.0"

_MODELS_DIR = Path(__file__).resolve().parent / "course_models"
COURSE_MODEL = str(_MODELS_DIR / "base")         # the shipped course model (Hugging Face format)
COURSE_DRAFT_MODEL = str(_MODELS_DIR / "draft")  # its much smaller sibling, the draft for speculation

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "COURSE_MODEL", "COURSE_DRAFT_MODEL", "perf"]

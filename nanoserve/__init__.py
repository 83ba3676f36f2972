"""nanoserve: a small LLM inference engine, built one chapter at a time.

    from nanoserve import LLM, SamplingParams, COURSE_MODEL

`import nanoserve` loads the engine and nothing else: any other subpackage a reader reaches as `nanoserve.X`
loads on first use, and the course's tooling lives apart, in `nanoserve.course`.
"""
import importlib
import importlib.util
import pkgutil

from nanoserve.engine.args import EngineArgs
from nanoserve.llm import LLM, CompletionOutput, RequestOutput
from nanoserve.models.shipped import COURSE_DRAFT_MODEL, COURSE_MODEL
from nanoserve.sampling import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # nanoserve.X loads nanoserve/X on first use (PEP 562), so `import nanoserve` stays the engine only
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {m.name for m in pkgutil.iter_modules(__path__)})


__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "COURSE_MODEL", "COURSE_DRAFT_MODEL", "perf"]

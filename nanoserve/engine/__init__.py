"""Chapter 03: the continuous-batching engine (sequence, scheduler, model runner, engine loop)."""
from nanoserve.engine.args import EngineArgs
from nanoserve.engine.llm_engine import EngineConfig, LLMEngine
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence, Status

__all__ = ["EngineArgs", "EngineConfig", "LLMEngine", "Scheduler", "Sequence", "Status"]

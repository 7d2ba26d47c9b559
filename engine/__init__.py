"""paged-serve's engine: requests, block manager, scheduler, model runner and the offline API."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import CompletionResult, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionResult", "EngineConfig", "RequestOutput", "SamplingParams"]

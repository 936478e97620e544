"""mlaserve: an LLM inference and serving engine built around Multi-head Latent Attention."""

from mlaserve.config.guide_options import ParallelConfig
from mlaserve.engine.llm_engine import EngineArgs, LLMEngine
from mlaserve.llm import LLM
from mlaserve.outputs import CompletionOutput, Logprob, RequestOutput
from mlaserve.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineArgs",
    "LLMEngine",
    "ParallelConfig",
]
__version__ = "0.1.0"

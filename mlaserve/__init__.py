"""mlaserve: an LLM inference and serving engine built around Multi-head Latent Attention."""

from mlaserve.llm import LLM
from mlaserve.outputs import CompletionOutput, RequestOutput
from mlaserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

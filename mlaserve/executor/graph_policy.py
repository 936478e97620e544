"""Which steps an executor runs as CUDA graphs: decode steps where the model and the backend can be captured, and
fresh prefills too where the prefill attention takes the model's dtype."""

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.kvcache.spec import FULL, KVCacheSpec
from mlaserve.models.base import CausalLM


def decode_graphs_apply(model: CausalLM, backend: AttentionBackend, spec: KVCacheSpec) -> bool:
    """The backends' captured decode reads one block table: models whose layers go through them with windowed
    layers (several cache groups) run eagerly. A model that attends on its own says for itself."""
    one_group = spec.group_rules() == [FULL]
    return model.supports_cuda_graphs and (
        model.attends_itself or (backend.supports_cuda_graphs and spec.is_mla and one_group)
    )


def prefill_graph_tokens(model: CausalLM, dtype: torch.dtype, max_step_tokens: int) -> int:
    """The largest fresh prefill captured (0: none). Those graphs need the varlen flash attention, which takes
    16-bit inputs only."""
    half = dtype in (torch.float16, torch.bfloat16) and model.supports_prefill_graphs
    return min(2048, max_step_tokens) if half else 0

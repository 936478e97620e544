"""The option names of the MLA deployment guides our users follow, mapped onto mlaserve's own options.

Their scripts pass these to `LLM(...)`, `EngineArgs(...)` or `LLMEngine.from_engine_args(...)`; each is translated
here, once, into the engine option that does the job (docs/guide-options.md has the table), or refused with a
message saying why. A name that is neither ours nor the guides' is still an error (EngineConfig.from_kwargs).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelConfig:
    """The guides' parallel layout: tensor_parallel_size ranks; mla_parallel_mode "expert" splits the MoE experts
    whole across them (the engine's enable_expert_parallel)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    mla_parallel_mode: str = "tensor"  # "tensor" | "expert": how the MoE layers split across ranks

    def __post_init__(self) -> None:
        if self.mla_parallel_mode not in ("tensor", "expert"):
            raise ValueError(
                f"mla_parallel_mode must be 'tensor' or 'expert', got {self.mla_parallel_mode!r}"
            )
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size}: pipeline parallelism is not built; "
                "mlaserve runs one pipeline stage"
            )


# Names with a one-to-one engine option: (engine option, how the value maps).
_RENAMED = {
    "enable_chunked_mla": ("enable_chunked_prefill", bool),
    "chunk_size": ("max_num_batched_tokens", int),
    "mla_window_size": ("sliding_window", lambda v: None if v == 0 else v),  # 0: global attention
    "capture_mla_graph": ("enforce_eager", lambda v: not v),
}
_REFUSED = {
    "mla_latent_dim_fn": "a rank chosen by context length is not built; give a fixed mla_latent_dim",
}


def translate(options: dict[str, object]) -> dict[str, object]:
    """`options` with the guides' names replaced by engine options (the rest passed through unchanged)."""
    options = dict(options)
    for name, why in _REFUSED.items():
        if options.pop(name, None) is not None:
            raise ValueError(f"{name}: {why}")
    for name, (target, convert) in _RENAMED.items():
        if name in options:
            _set(options, target, convert(options.pop(name)), name)
    on, off = options.pop("enable_mla_quant", None), options.pop("disable_mla_quant", None)
    if on and off:
        raise ValueError("enable_mla_quant and disable_mla_quant are both set; give one")
    if on or off is False:
        _set(options, "kv_cache_dtype", "fp8_e4m3", "enable_mla_quant")
    elif off or on is False:
        _set(options, "kv_cache_dtype", "auto", "disable_mla_quant")
    if options.pop("enable_mla_tensor_core", None) is not None:
        logger.info("enable_mla_tensor_core: accepted; the MLA kernels always run on tensor cores")
    if options.pop("mla_ascend_mode", False):
        raise ValueError("mla_ascend_mode: mlaserve has no Ascend backend (CUDA GPUs and CPUs only)")
    ratio = options.pop("mla_kv_cache_ratio", None)
    if ratio is not None:
        if not (isinstance(ratio, int | float) and 0 < ratio < 1):
            raise ValueError(f"mla_kv_cache_ratio must be in (0, 1), got {ratio!r}")
        device = str(options.get("device", "auto"))
        _set(options, "kv_cache_memory_bytes", int(ratio * _device_memory(device)), "mla_kv_cache_ratio")
    parallel = options.pop("parallel_config", None)
    if parallel is not None:
        if not isinstance(parallel, ParallelConfig):
            raise TypeError(f"parallel_config must be a ParallelConfig, got {type(parallel).__name__}")
        _set(options, "tensor_parallel_size", parallel.tensor_parallel_size, "parallel_config")
        if parallel.mla_parallel_mode == "expert":
            _set(options, "enable_expert_parallel", True, "parallel_config")
    if options.get("trust_remote_code"):
        logger.info("trust_remote_code: accepted; mlaserve never runs code shipped with a checkpoint")
    return options


def _set(options: dict[str, object], target: str, value: object, source: str) -> None:
    if target in options and options[target] != value:
        raise ValueError(f"{source} sets {target}={value!r}, but {target}={options[target]!r} is also given")
    options[target] = value


def _device_memory(device: str) -> int:
    """Total memory of the device the engine will run on (the GPU's, or the machine's RAM on CPU)."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        index = torch.device(device if device.startswith("cuda") else "cuda").index or 0
        return torch.cuda.get_device_properties(index).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

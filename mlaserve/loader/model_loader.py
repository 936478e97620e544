"""Builds a model on its device and fills it from the checkpoint (or randomly for load_format="dummy")."""

import logging

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.config.model_config import ModelConfig
from mlaserve.loader.model_files import ModelFiles
from mlaserve.loader.weights import LoadReport, init_dummy_weights, load_weights
from mlaserve.models.base import CausalLM
from mlaserve.models.registry import get_model_class
from mlaserve.parallel import SINGLE, ParallelContext

logger = logging.getLogger(__name__)


def checkpoint_tensors(files: ModelFiles):
    if files.kind == "gguf":
        from mlaserve.loader.gguf_reader import iter_gguf_tensors

        return iter_gguf_tensors(files.path)
    from mlaserve.loader.safetensors_reader import iter_safetensor_slices

    return iter_safetensor_slices(files.path)  # a tensor-parallel rank reads only its part of each


def pack_cpu_weights(model: torch.nn.Module) -> None:
    """Reorder final weights for cpu_gemm where it applies (float32 on CPU); a no-op elsewhere."""
    for module in model.modules():
        if hasattr(module, "pack_weights"):
            module.pack_weights()


def build_model(
    model_config: ModelConfig,
    files: ModelFiles,
    backend: AttentionBackend,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    mla_disable: bool = False,
    enable_mla: bool = False,
    mla_skip_layers: tuple[int, ...] = (),
    parallel: ParallelContext = SINGLE,
) -> tuple[CausalLM, LoadReport]:
    """parallel: this rank's slice of a tensor-parallel model (its layers take their part of each weight)."""
    cls = get_model_class(model_config.architecture)  # before any allocation: unsupported is a cheap error
    options = {}
    if mla_disable:
        if not cls.supports_mla_disable:
            raise ValueError(
                f"mla_disable applies to MLA models only; {model_config.architecture} has no latent cache"
            )
        options["mla_disable"] = True
    if enable_mla:
        if not cls.supports_enable_mla:
            raise ValueError(
                f"enable_mla converts models with per-head K/V caches (Llama, Qwen2, Mistral); "
                f"{model_config.architecture} cannot be converted"
            )
        options["enable_mla"] = True
        if mla_skip_layers:
            options["mla_skip_layers"] = mla_skip_layers
    if parallel.distributed:
        options["ctx"] = parallel
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = cls(model_config.hf_config, backend, **options)
    finally:
        torch.set_default_dtype(previous)
    model.to(device)  # rotary buffers built from CPU tensors
    if load_format == "dummy":
        report = init_dummy_weights(model, seed)
    else:
        report = load_weights(model, checkpoint_tensors(files))
        report.raise_if_bad(files.path)
    model.process_weights_after_loading()
    pack_cpu_weights(model)
    model.eval()
    logger.info("model %s: %s", model_config.architecture, report.summary())
    return model, report

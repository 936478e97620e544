"""Builds a model on its device and fills it from the checkpoint (or randomly for load_format="dummy")."""

import logging
from dataclasses import dataclass, field

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.config.engine_config import MLAOptions, ModelOptions
from mlaserve.config.model_config import ModelConfig
from mlaserve.loader.model_files import ModelFiles
from mlaserve.loader.weights import LoadReport, init_dummy_weights, load_weights, weight_bytes_by_kind
from mlaserve.models.base import CausalLM, ModelInit
from mlaserve.models.mtp import check_mtp_weights
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


def check_weights_fit(cls: type, init: ModelInit, device: torch.device) -> None:
    """On a GPU, the model's weights (FP8 where quantized) against the memory free before any is allocated: the
    model is built on the meta device, which allocates nothing, and its parameters counted."""
    if device.type != "cuda":
        return
    try:
        with torch.device("meta"):
            meta = cls(init)
    except NotImplementedError as e:  # a layer that computes from data at construction: no estimate, no check
        logger.warning("weights not sized before loading (%s)", e)
        return
    need = sum(p.numel() * p.element_size() for p in meta.parameters())
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        quant = f" ({init.quant.name} weights)" if init.quant else ""
        raise ValueError(
            f"the model's weights{quant} need {need / 2**30:.1f} GiB on this rank, and the GPU has {free / 2**30:.1f} "
            "GiB free; use more tensor-parallel ranks, quantization='fp8', or a smaller model"
        )


@dataclass(frozen=True)
class ModelBuild:
    """What build_model builds from: the model's config and files, the backend its attention layers call, the
    device its weights go to, how they load (model: load_format, seed) and how its attention caches (mla)."""

    model_config: ModelConfig
    files: ModelFiles
    backend: AttentionBackend
    device: torch.device
    model: ModelOptions = field(default_factory=ModelOptions)
    mla: MLAOptions = field(default_factory=MLAOptions)
    parallel: ParallelContext = SINGLE  # this rank's slice (its layers take their part of each weight)
    mtp_layers: int = 0  # multi-token-prediction layers to build (models/mtp.py)


def build_model(build: ModelBuild) -> tuple[CausalLM, LoadReport]:
    model_config, files, device, parallel = build.model_config, build.files, build.device, build.parallel
    cls = get_model_class(model_config.architecture)  # before any allocation: unsupported is a cheap error
    mla = build.mla
    if mla.mla_disable and not cls.supports_mla_disable:
        raise ValueError(
            f"mla_disable applies to MLA models only; {model_config.architecture} has no latent cache"
        )
    if mla.enable_mla and not cls.supports_enable_mla:
        raise ValueError(
            f"enable_mla converts models with per-head K/V caches (Llama, Qwen2, Mistral); "
            f"{model_config.architecture} cannot be converted"
        )
    quant = model_config.quant
    if quant is not None and not cls.supports_block_fp8:
        raise ValueError(f"{model_config.architecture} does not take block-FP8 weights (quantization fp8)")
    if quant is not None and quant.expert_dtype == "fp4" and not cls.supports_mxfp4_experts:
        raise ValueError(
            f"{model_config.architecture} does not take MXFP4 experts (quantization_config expert_dtype 'fp4'); "
            "DeepSeek-V4 does"
        )
    if quant is not None and mla.enable_mla:
        raise ValueError(
            "enable_mla converts unquantized weights; it cannot be combined with fp8 quantization"
        )
    init = ModelInit(
        model_config.hf_config,
        build.backend,
        parallel,
        mla_disable=mla.mla_disable,
        enable_mla=mla.enable_mla,
        mla_skip_layers=tuple(mla.mla_skip_layers) if mla.enable_mla else (),
        quant=quant,
        mtp_layers=build.mtp_layers,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        check_weights_fit(cls, init, device)
        with torch.device(device):
            model = cls(init)
    finally:
        torch.set_default_dtype(previous)
    model.to(device)  # rotary buffers built from CPU tensors
    if build.model.load_format == "dummy":
        report = init_dummy_weights(model, build.model.seed)
    else:
        report = load_weights(model, checkpoint_tensors(files))
        if build.mtp_layers:
            check_mtp_weights(report.missing, model_config.hf_config.num_hidden_layers)
        report.raise_if_bad(files.path)
    model.process_weights_after_loading()
    pack_cpu_weights(model)
    model.eval()
    report.bytes_by_kind = weight_bytes_by_kind(model)
    logger.info("model %s: %s", model_config.architecture, report.summary())
    return model, report

"""The model an executor serves: built and loaded on its device, then converted to MLA where asked, either from a
folder `mlaserve convert` wrote (no calibration) or by calibrating on text now."""

from __future__ import annotations

import dataclasses
import logging

import torch

from mlaserve.attention.backend import AttentionBackend
from mlaserve.config.engine_config import EngineConfig
from mlaserve.config.model_config import ModelConfig
from mlaserve.conversion.folder import apply_saved_conversion
from mlaserve.executor.load_model import ModelBuild, build_model
from mlaserve.loader.model_files import ModelFiles
from mlaserve.loader.weights import LoadReport
from mlaserve.models.base import CausalLM
from mlaserve.models.mtp import mtp_layers_to_build
from mlaserve.models.registry import get_model_class
from mlaserve.parallel import ParallelContext

logger = logging.getLogger(__name__)


def with_saved_conversion(config: EngineConfig, saved: dict) -> EngineConfig:
    """A converted folder serves as converted: enable_mla and the skipped layers come from its config.json."""
    mla = config.mla
    given = [name for name in ("mla_latent_dim", "qk_rope_head_dim") if getattr(mla, name) is not None]
    if given or mla.mla_skip_layers or mla.mla_rank_allocation != "uniform":
        raise ValueError(
            f"{config.model.path} was converted by `mlaserve convert` (config.json's mlaserve_mla section); it takes no "
            f"conversion options of its own ({', '.join(given) or 'mla_skip_layers / mla_rank_allocation'})"
        )
    skip = tuple(saved.get("mla_skip_layers", ()))
    return dataclasses.replace(config, mla=dataclasses.replace(mla, enable_mla=True, mla_skip_layers=skip))


def load_model(
    config: EngineConfig,
    model_config: ModelConfig,
    files: ModelFiles,
    saved: dict | None,
    backend: AttentionBackend,
    device: torch.device,
    parallel: ParallelContext,
    tokenizer: object | None,
) -> tuple[CausalLM, LoadReport]:
    """saved: the conversion section of a converted folder's config.json, when it is one."""
    cls = get_model_class(model_config.architecture)
    mtp = mtp_layers_to_build(cls, model_config.architecture, model_config.hf_config, config.speculative)
    model, report = build_model(
        ModelBuild(model_config, files, backend, device, config.model, config.mla, parallel, mtp)
    )
    if saved is not None:
        apply_saved_conversion(model, files.path)
        logger.info(
            "MLA conversion read from %s: kv_lora_rank per layer %s, KV bytes per token %s",
            files.path,
            saved["ranks"],
            saved["kv_bytes_per_token"],
        )
    elif config.mla.converts:
        convert_to_low_rank_mla(model, config, model_config, tokenizer, device)
    return model, report


def convert_to_low_rank_mla(
    model: CausalLM,
    config: EngineConfig,
    model_config: ModelConfig,
    tokenizer: object | None,
    device: torch.device,
) -> None:
    """enable_mla at reduced rank: the exact latent layers converted from calibration activations."""
    from mlaserve.conversion.mla import calibration_text, convert_model

    if tokenizer is None:
        raise ValueError("mla_latent_dim / qk_rope_head_dim calibrate on text: they need the tokenizer")
    ids = tokenizer.encode(calibration_text())[: min(2048, model_config.max_model_len)]
    if len(ids) < 64:
        raise ValueError(
            f"the calibration text encodes to {len(ids)} tokens with this model's tokenizer: too few to convert"
        )
    mla = config.mla
    report = convert_model(
        model,
        mla.mla_latent_dim,
        mla.qk_rope_head_dim,
        ids,
        config.cache.block_size,
        device,
        mla.mla_rank_allocation,
    )
    logger.info(report)

"""Engine options checked against the model before anything loads: what its cache cannot take is an error that
names the option, not a failure after minutes of loading weights."""

from mlaserve.config.engine_config import EngineConfig
from mlaserve.config.model_config import ModelConfig, layer_windows
from mlaserve.conversion.mla import check_options as check_conversion
from mlaserve.kvcache.quant import resolve_cache_dtype
from mlaserve.models.registry import get_model_class
from mlaserve.parallel.layout import layout_problems


def check_engine_options(config: EngineConfig, model_config: ModelConfig) -> None:
    model_cls = get_model_class(model_config.architecture)
    if config.parallel.distributed:
        check_parallel(config, model_config, model_cls)
    elif config.parallel.enable_expert_parallel:
        raise ValueError("enable_expert_parallel splits experts across tensor-parallel ranks: it needs them")
    mla, cache = config.mla, config.cache
    heads = getattr(model_config.hf_config, "num_attention_heads", None)
    if mla.mla_num_heads is not None and mla.mla_num_heads != heads:
        raise ValueError(
            f"mla_num_heads={mla.mla_num_heads}, but {model_config.architecture} has {heads} attention heads; "
            "the head count is the model's and cannot be changed"
        )
    if mla.enable_mla and not model_cls.supports_enable_mla:
        raise ValueError(
            "enable_mla converts models with per-head K/V caches (Llama, Qwen2, Mistral); "
            f"{model_config.architecture} cannot be converted"
        )
    layers = getattr(model_config.hf_config, "num_hidden_layers", None)
    skip = mla.mla_skip_layers
    missing = [i for i in skip if layers is not None and i >= layers]
    if missing:
        raise ValueError(
            f"mla_skip_layers: {model_config.architecture} has layers 0-{layers - 1}; no layer {missing}"
        )
    if layers is not None and mla.enable_mla and len(set(skip)) >= layers:
        raise ValueError("mla_skip_layers lists every layer: no layer would be served from the latent cache")
    if skip and cache.kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype={cache.kv_cache_dtype!r} with mla_skip_layers: the 8-bit caches hold latent rows "
            "only, and the skipped layers cache per-head K/V"
        )
    latent = model_cls.latent_cache(mla.mla_disable, mla.enable_mla) and not skip
    if mla.converts:
        converted = None if layers is None else layers - len(set(skip))
        check_conversion(model_config.hf_config, mla.mla_latent_dim, mla.qk_rope_head_dim, converted)
    windows = [w for w in layer_windows(model_config.hf_config) if w is not None]
    if mla.enable_mla and windows and min(windows) < model_config.max_model_len:
        raise ValueError(
            f"enable_mla with sliding-window layers (window {min(windows)} < max_model_len="
            f"{model_config.max_model_len}) is not supported yet: the latent decode kernels take no window; "
            "lower max_model_len to the window"
        )
    resolve_cache_dtype(cache.kv_cache_dtype, model_config.dtype, latent or model_cls.segmented_8bit_cache)
    for option in ("sliding_window", "compress_ratio", "index_topk"):
        if getattr(cache, option) and (latent or not model_cls.training_free_window):
            why = (
                "the latent-cache decode kernels take no window"
                if latent
                else f"{model_config.architecture} attends through its own windows and compressed caches"
            )
            raise ValueError(
                f"{option} applies to models with per-head K/V caches so far (Llama, Qwen2, Mistral, or an MLA "
                f"model with mla_disable): {why}"
            )
    if cache.compress_ratio and windows and len(windows) == len(layer_windows(model_config.hf_config)):
        raise ValueError(
            f"compress_ratio pools what full-attention layers see before the window, and every layer of "
            f"{model_config.architecture} attends through its own window (config.json sliding_window={min(windows)})"
        )


def check_parallel(config: EngineConfig, model_config: ModelConfig, model_cls: type) -> None:
    """The layout, before any worker starts or weight loads."""
    parallel, arch = config.parallel, model_config.architecture
    size = parallel.tensor_parallel_size
    if not model_cls.supports_tensor_parallel:
        raise ValueError(f"tensor parallelism does not support {arch} yet")
    if config.mla.enable_mla or config.mla.converts:
        raise ValueError("enable_mla (GQA -> MLA conversion) is not supported with tensor parallelism yet")
    quant = model_config.quant
    block = quant.block_k if quant is not None and quant.from_checkpoint else None
    fp4 = quant is not None and quant.expert_dtype == "fp4"
    problems = layout_problems(model_config.hf_config, size, parallel.enable_expert_parallel, block, fp4)
    if problems:
        raise ValueError(f"{arch} cannot be split over {size} ranks: " + "; ".join(problems))

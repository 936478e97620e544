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
    if config.distributed:
        check_parallel(config, model_config, model_cls)
    elif config.enable_expert_parallel:
        raise ValueError("enable_expert_parallel splits experts across tensor-parallel ranks: it needs them")
    heads = getattr(model_config.hf_config, "num_attention_heads", None)
    if config.mla_num_heads is not None and config.mla_num_heads != heads:
        raise ValueError(
            f"mla_num_heads={config.mla_num_heads}, but {model_config.architecture} has {heads} attention heads; "
            "the head count is the model's and cannot be changed"
        )
    if config.enable_mla and not model_cls.supports_enable_mla:
        raise ValueError(
            "enable_mla converts models with per-head K/V caches (Llama, Qwen2, Mistral); "
            f"{model_config.architecture} cannot be converted"
        )
    layers = getattr(model_config.hf_config, "num_hidden_layers", None)
    missing = [i for i in config.mla_skip_layers if layers is not None and i >= layers]
    if missing:
        raise ValueError(
            f"mla_skip_layers: {model_config.architecture} has layers 0-{layers - 1}; no layer {missing}"
        )
    if layers is not None and config.enable_mla and len(set(config.mla_skip_layers)) >= layers:
        raise ValueError("mla_skip_layers lists every layer: no layer would be served from the latent cache")
    if config.mla_skip_layers and config.kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype={config.kv_cache_dtype!r} with mla_skip_layers: the 8-bit caches hold latent rows "
            "only, and the skipped layers cache per-head K/V"
        )
    latent = model_cls.latent_cache(config.mla_disable, config.enable_mla) and not config.mla_skip_layers
    if config.mla_latent_dim or config.qk_rope_head_dim:
        converted = None if layers is None else layers - len(set(config.mla_skip_layers))
        check_conversion(model_config.hf_config, config.mla_latent_dim, config.qk_rope_head_dim, converted)
    windows = [w for w in layer_windows(model_config.hf_config) if w is not None]
    if config.enable_mla and windows and min(windows) < model_config.max_model_len:
        raise ValueError(
            f"enable_mla with sliding-window layers (window {min(windows)} < max_model_len="
            f"{model_config.max_model_len}) is not supported yet: the latent decode kernels take no window; "
            "lower max_model_len to the window"
        )
    resolve_cache_dtype(config.kv_cache_dtype, model_config.dtype, latent)
    for option in ("sliding_window", "compress_ratio", "index_topk"):
        if getattr(config, option) and (latent or not model_cls.training_free_window):
            why = (
                "the latent-cache decode kernels take no window"
                if latent
                else f"{model_config.architecture} attends through its own windows and compressed caches"
            )
            raise ValueError(
                f"{option} applies to models with per-head K/V caches so far (Llama, Qwen2, Mistral, or an MLA "
                f"model with mla_disable): {why}"
            )
    if config.compress_ratio and windows and len(windows) == len(layer_windows(model_config.hf_config)):
        raise ValueError(
            f"compress_ratio pools what full-attention layers see before the window, and every layer of "
            f"{model_config.architecture} attends through its own window (config.json sliding_window={min(windows)})"
        )


def check_parallel(config: EngineConfig, model_config: ModelConfig, model_cls: type) -> None:
    """The layout, before any worker starts or weight loads."""
    size, arch = config.tensor_parallel_size, model_config.architecture
    if not model_cls.supports_tensor_parallel:
        raise ValueError(f"tensor parallelism does not support {arch} yet")
    converting = config.enable_mla or config.mla_latent_dim or config.qk_rope_head_dim
    if converting:
        raise ValueError("enable_mla (GQA -> MLA conversion) is not supported with tensor parallelism yet")
    problems = layout_problems(model_config.hf_config, size, config.enable_expert_parallel)
    if problems:
        raise ValueError(f"{arch} cannot be split over {size} ranks: " + "; ".join(problems))

"""ModelConfig: the facts about a checkpoint the engine needs, parsed by transformers' own config classes."""

import logging
from dataclasses import dataclass

import torch

from mlaserve.config.quantization import BlockFP8Config, quant_config

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


# Model types that older transformers releases lack, read with the config class of the model they extend: every
# field of config.json is kept, so the extension's own fields (the V3.2 indexer's) are there to read.
_CONFIG_FALLBACK = {"deepseek_v32": "deepseek_v3"}


# Configs read without their transformers class where it is missing (older transformers, as on the GPU image):
# config.json must then spell out every field the model reads, as transformers' save_pretrained writes them.
_SPELLED_OUT = {
    "deepseek_v4": ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "qk_rope_head_dim")
}


def spelled_out_config(config_dict: dict) -> object:
    from transformers import PretrainedConfig

    model_type = config_dict["model_type"]
    missing = [name for name in _SPELLED_OUT[model_type] if name not in config_dict]
    if missing:
        raise ValueError(
            f"this transformers has no {model_type!r} config class, and config.json leaves {', '.join(missing)} "
            "to it: save the config with a transformers that has the class, or upgrade transformers"
        )
    logger.info("transformers has no %r config; reading config.json's fields as they are", model_type)
    # the generic class validates layer-type lists against the types it knows: set them after construction
    later = ("model_type", "layer_types", "mlp_layer_types")
    config = PretrainedConfig(**{k: v for k, v in config_dict.items() if k not in later})
    for name in later:
        setattr(config, name, config_dict[name])
    return config


def hf_config_from_dict(config_dict: dict) -> object:
    """A transformers PretrainedConfig from a config.json dict; rope_scaling is normalised to rope_parameters."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config_dict.get("model_type")
    if not model_type:
        raise ValueError("config.json has no 'model_type'")
    if model_type not in CONFIG_MAPPING and model_type in _SPELLED_OUT:
        return spelled_out_config(config_dict)
    if model_type not in CONFIG_MAPPING:
        if model_type not in _CONFIG_FALLBACK:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json")
        logger.info(
            "transformers has no %r config; reading it as %r", model_type, _CONFIG_FALLBACK[model_type]
        )
        model_type = _CONFIG_FALLBACK[model_type]
    fields = {k: v for k, v in config_dict.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers' validators raise several kinds; each names the field
        raise ValueError(f"config.json is not a valid {model_type} config: {e}") from None
    # DeepSeek's compress_ratios has an entry per block and MTP layer; transformers keeps the blocks' alone
    ratios = config_dict.get("compress_ratios")
    if isinstance(ratios, list) and len(ratios) > config.num_hidden_layers:
        config.mtp_compress_ratios = ratios[config.num_hidden_layers :]
    return config


def resolve_dtype(requested: str | torch.dtype, hf_config: object, device: torch.device) -> torch.dtype:
    if isinstance(requested, torch.dtype):
        return requested
    if requested == "auto":
        declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(declared, str):
            declared = _DTYPES.get(declared, torch.float32)
        declared = declared or torch.float32
        if device.type == "cpu" and declared != torch.float32:
            logger.info(
                "dtype auto on CPU: using float32 instead of %s (half precision GEMMs are slow on CPU)",
                declared,
            )
            return torch.float32
        return declared
    if requested not in _DTYPES:
        raise ValueError(f"unknown dtype {requested!r}; choose one of 'auto', {sorted(_DTYPES)}")
    return _DTYPES[requested]


def sliding_window(hf_config: object) -> int | None:
    """The attention window the reference applies, if any (Mistral always, Qwen2 only with use_sliding_window)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return None
    return int(window)


def layer_windows(hf_config: object) -> list[int | None]:
    """Each layer's attention window (None: full attention), as transformers applies them: a config's
    `layer_types` names the "sliding_attention" layers (Qwen2 derives it from use_sliding_window and
    max_window_layers); without it every layer takes the model's window (Mistral)."""
    window = sliding_window(hf_config)
    if window is not None and window < 1:
        raise ValueError(f"config.json: sliding_window must be a positive number of tokens, got {window}")
    num_layers = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if types is None:
        return [window] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for {num_layers} layers")
    return [window if t == "sliding_attention" else None for t in types]


def check_compressed_attention(hf_config: object) -> None:
    """DeepSeek-V4's attention (a config with compress_rates): every layer has a window, each compressed layer kind
    its rate, and the grouped output projection splits the heads evenly."""
    rates = getattr(hf_config, "compress_rates", None)
    if rates is None:
        return
    window = getattr(hf_config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"config.json: sliding_window must be a positive number of tokens, got {window!r}")
    for kind in sorted(set(hf_config.layer_types) - {"sliding_attention"}):
        rate = rates.get(kind) if isinstance(rates, dict) else None
        if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
            raise ValueError(
                f"config.json: compress_rates[{kind!r}] must be a positive integer, got {rate!r}"
            )
    heads, groups = hf_config.num_attention_heads, getattr(hf_config, "o_groups", None)
    if not isinstance(groups, int) or groups < 1 or heads % groups:
        raise ValueError(f"config.json: o_groups={groups!r} must divide num_attention_heads={heads}")


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek-V3.2's lightning indexer: index_n_heads query heads of index_head_dim (the first qk_rope_head_dim
    of them rotated) score every cached token; each query attends to its index_topk best."""

    topk: int
    num_heads: int
    head_dim: int
    rope_dim: int


def indexer_config(hf_config: object) -> IndexerConfig | None:
    """The indexer a config declares (index_topk), checked against the model's shapes; None without one."""
    topk = getattr(hf_config, "index_topk", None)
    if topk is None:
        return None
    heads, dim = getattr(hf_config, "index_n_heads", None), getattr(hf_config, "index_head_dim", None)
    rope = getattr(hf_config, "qk_rope_head_dim", None)
    for name, value in (("index_topk", topk), ("index_n_heads", heads), ("index_head_dim", dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
    if not isinstance(rope, int) or rope % 2 or rope > dim:
        raise ValueError(
            f"config.json: the indexer rotates the first qk_rope_head_dim={rope!r} of its index_head_dim={dim} "
            "features, so qk_rope_head_dim must be even and at most index_head_dim"
        )
    if not getattr(hf_config, "q_lora_rank", None):
        raise ValueError(
            "config.json: the indexer's queries come from the low-rank query path; set q_lora_rank"
        )
    return IndexerConfig(topk, heads, dim, rope)


@dataclass(frozen=True)
class ModelConfig:
    hf_config: object
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    quant: BlockFP8Config | None = None  # the linear layers' weight format; None: the model's dtype

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def eos_token_ids(self) -> list[int]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    @classmethod
    def from_hf(
        cls,
        config_dict: dict,
        dtype: str | torch.dtype,
        device: torch.device,
        max_model_len: int | None,
        quantization: str | None = None,
    ) -> "ModelConfig":
        quant = quant_config(
            config_dict, quantization
        )  # a format the layers cannot read, before any weight loads
        hf_config = hf_config_from_dict(config_dict)
        archs = config_dict.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        layer_windows(
            hf_config
        )  # a window or top-k that cannot be served is an error before any weight loads
        indexer_config(hf_config)
        check_compressed_attention(hf_config)
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        limit_name = "max_position_embeddings"
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        elif max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's {limit_name}={limit}")
        return cls(hf_config, archs[0], resolve_dtype(dtype, hf_config, device), max_model_len, quant)

"""Which quantized checkpoint formats the engine serves, checked from config.json before any weight is read, and
the block-FP8 settings the layers are built with.

A checkpoint's `quantization_config` (transformers' convention: `quant_method` names the format) changes what its
weight files hold: packed integers, scales, zero points. Reading such a file as if it were unquantized loads
garbage or fails deep in the loader with a shape error, so a method the engine has no linear method for is refused
here, by name, and a served method's settings the kernels cannot run are refused by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The `quant_method` values whose weights the loader and layers can read. GGUF files are not listed: their
# quantized tensors are dequantized on load and their configs carry no quantization_config.
SERVED_QUANT_METHODS: tuple[str, ...] = ("fp8",)
# What `quantization=` (LLM keyword, model.quantization, --quantization) can ask of an unquantized checkpoint.
ONLINE_METHODS: tuple[str, ...] = ("fp8",)
# The routed experts' formats a block-FP8 checkpoint may state: FP8 blocks like its linears, or MXFP4.
EXPERT_DTYPES: tuple[str, ...] = ("fp8", "fp4")
# The block width every FP8 kernel's inner loop takes: one weight scale and one activation scale per 128 columns.
KERNEL_BLOCK_K = 128

_UNQUANTIZED = "unquantized bf16/fp16/fp32 checkpoints"


@dataclass(frozen=True)
class BlockFP8Config:
    """Weights in float8_e4m3fn with a float32 scale per block_n x block_k block (DeepSeek-V3's format);
    activations quantized per token in groups of block_k as each GEMM runs (activation_scheme dynamic)."""

    block_n: int = 128
    block_k: int = KERNEL_BLOCK_K
    from_checkpoint: bool = (
        False  # the files hold FP8 weights and their scales; else float weights quantized on load
    )
    pow2_scales: bool = (
        False  # scale_fmt ue8m0 (DeepSeek-V3.1): activation scales rounded up to powers of two
    )
    # the routed experts' format: "fp8" like the linears, or "fp4" (DeepSeek-V4: MXFP4, layers/mxfp4.py)
    expert_dtype: str = "fp8"

    @property
    def name(self) -> str:
        return "fp8"


def quant_method(config_dict: dict[str, Any]) -> str | None:
    """The checkpoint's quantization method; None for an unquantized one, "unknown" where a
    quantization_config does not name its method."""
    section = config_dict.get("quantization_config")
    if section is None:  # transformers writes null for "not quantized" as well as leaving the key out
        return None
    method = section.get("quant_method") if isinstance(section, dict) else None
    return method if isinstance(method, str) and method else "unknown"


def check_quantization(config_dict: dict[str, Any], requested: str | None = None) -> None:
    """Raises ValueError naming the method and the served ones if the checkpoint's format is not served, or the
    key of a served format's setting the kernels cannot run."""
    quant_config(config_dict, requested)


def quant_config(config_dict: dict[str, Any], requested: str | None = None) -> BlockFP8Config | None:
    """The weight format the layers are built with: the checkpoint's own, or `requested` applied on load to an
    unquantized checkpoint; None for unquantized serving."""
    if requested is not None and requested not in ONLINE_METHODS:
        raise ValueError(
            f"quantization={requested!r} is not served; use one of {list(ONLINE_METHODS)} or None"
        )
    method = quant_method(config_dict)
    if method is None:
        if config_dict.get("expert_dtype") not in (None, "bf16", "bfloat16"):
            raise ValueError(
                f"model config expert_dtype={config_dict['expert_dtype']!r} without a quantization_config: "
                "quantized experts are read only with the block-FP8 section that describes the other weights"
            )
        return BlockFP8Config() if requested == "fp8" else None
    if method not in SERVED_QUANT_METHODS:
        named = "unknown (quantization_config has no quant_method)" if method == "unknown" else repr(method)
        served = f"{', '.join(repr(m) for m in SERVED_QUANT_METHODS)} (and {_UNQUANTIZED})"
        raise ValueError(
            f"model config quantization_config.quant_method {named} is not served; served methods: {served}"
        )
    if requested is not None and requested != method:
        raise ValueError(f"quantization={requested!r} asked for a checkpoint already quantized as {method!r}")
    return _block_fp8(config_dict["quantization_config"], config_dict.get("expert_dtype"))


def _block_fp8(section: dict[str, Any], top_level_expert_dtype: object = None) -> BlockFP8Config:
    """top_level_expert_dtype: config.json's own expert_dtype, where DeepSeek-V4-Flash states its experts' format
    (later releases state it inside quantization_config, which wins where both are given)."""

    def bad(key: str, value: object, want: str) -> ValueError:
        return ValueError(f"model config quantization_config.{key}={value!r} is not served: {want}")

    fmt = section.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise bad("fmt", fmt, "FP8 weights are read as float8_e4m3fn ('e4m3')")
    scheme = section.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise bad(
            "activation_scheme", scheme, "activations are quantized per token as each GEMM runs ('dynamic')"
        )
    block = section.get("weight_block_size")
    if block is None:
        raise bad(
            "weight_block_size", None, "per-tensor FP8 scales are not read; block scales ([128, 128]) are"
        )
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise bad("weight_block_size", block, "two positive ints [rows, columns]")
    if block[1] != KERNEL_BLOCK_K:
        raise bad("weight_block_size", block, f"the kernels take blocks {KERNEL_BLOCK_K} columns wide")
    scale_fmt = section.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise bad("scale_fmt", scale_fmt, "float32 scales (no scale_fmt) or 'ue8m0'")
    key = "expert_dtype" if "expert_dtype" in section else None
    expert_dtype = section.get("expert_dtype", top_level_expert_dtype)
    if expert_dtype is None:
        expert_dtype = "fp8"
    if expert_dtype not in EXPERT_DTYPES:
        where = "quantization_config.expert_dtype" if key else "expert_dtype"
        raise ValueError(
            f"model config {where}={expert_dtype!r} is not served: routed experts are read as "
            f"{' or '.join(repr(d) for d in EXPERT_DTYPES)}"
        )
    return BlockFP8Config(block[0], block[1], True, scale_fmt == "ue8m0", expert_dtype)

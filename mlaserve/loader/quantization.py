"""Which quantized checkpoint formats the engine serves, checked from config.json before any weight is read.

A checkpoint's `quantization_config` (transformers' convention: `quant_method` names the format) changes what its
weight files hold: packed integers, scales, zero points. Reading such a file as if it were unquantized loads
garbage or fails deep in the loader with a shape error, so a method the engine has no linear method for is refused
here, by name. Serving a method means adding it to SERVED_QUANT_METHODS together with its loader and layers.
"""

from __future__ import annotations

from typing import Any

# The `quant_method` values whose weights the loader and layers can read. GGUF files are not listed: their
# quantized tensors are dequantized on load and their configs carry no quantization_config.
SERVED_QUANT_METHODS: tuple[str, ...] = ()

_UNQUANTIZED = "unquantized bf16/fp16/fp32 checkpoints"


def quant_method(config_dict: dict[str, Any]) -> str | None:
    """The checkpoint's quantization method; None for an unquantized one, "unknown" where a
    quantization_config does not name its method."""
    section = config_dict.get("quantization_config")
    if section is None:  # transformers writes null for "not quantized" as well as leaving the key out
        return None
    method = section.get("quant_method") if isinstance(section, dict) else None
    return method if isinstance(method, str) and method else "unknown"


def check_quantization(config_dict: dict[str, Any]) -> None:
    """Raises ValueError naming the method and the served ones if the checkpoint's format is not served."""
    method = quant_method(config_dict)
    if method is None or method in SERVED_QUANT_METHODS:
        return
    named = "unknown (quantization_config has no quant_method)" if method == "unknown" else repr(method)
    if SERVED_QUANT_METHODS:
        served = f"{', '.join(repr(m) for m in SERVED_QUANT_METHODS)} (and {_UNQUANTIZED})"
    else:
        served = f"none ({_UNQUANTIZED} only)"
    raise ValueError(
        f"model config quantization_config.quant_method {named} is not served; served methods: {served}"
    )

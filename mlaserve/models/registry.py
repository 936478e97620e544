"""Architecture name (config.json "architectures") -> model class, imported lazily."""

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("mlaserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("mlaserve.models.llama", "Qwen2ForCausalLM"),
    "MistralForCausalLM": ("mlaserve.models.llama", "MistralForCausalLM"),
    "DeepseekV2ForCausalLM": ("mlaserve.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("mlaserve.models.deepseek", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("mlaserve.models.deepseek", "DeepseekV32ForCausalLM"),
    "DeepseekV4ForCausalLM": ("mlaserve.models.deepseek_v4", "DeepseekV4ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)

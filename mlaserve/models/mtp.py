"""Which multi-token-prediction (MTP) layers a model builds: DeepSeek-V3's and V4's checkpoints ship
num_nextn_predict_layers of them after the decoder layers, and the speculative method "mtp" runs the first as its
draft model. The layer itself is DeepseekMTP (models/deepseek.py) or V4MTP (models/deepseek_v4_mtp.py); the
drafting pass is runner/mtp_draft.py."""

from __future__ import annotations

from mlaserve.config.speculative import SpeculativeOptions


def mtp_layers_to_build(cls: type, architecture: str, hf_config: object, spec: SpeculativeOptions) -> int:
    """1 when the speculative method is "mtp" and the model can serve it, else 0; a ValueError that says why
    when the method asks for what the model does not have."""
    if spec.method != "mtp":
        return 0
    if not getattr(cls, "supports_mtp", False):
        raise ValueError(
            f"speculative_config method 'mtp' runs DeepSeek-V3/V3.2/V4's multi-token-prediction layer; "
            f"{architecture} has none (use method 'ngram')"
        )
    shipped = getattr(hf_config, "num_nextn_predict_layers", 0) or 0
    if shipped < 1:
        raise ValueError(
            "speculative_config method 'mtp' needs the checkpoint's multi-token-prediction layer, and its "
            f"config.json has num_nextn_predict_layers={shipped} (a checkpoint without it: use method 'ngram')"
        )
    return 1


def check_mtp_weights(missing: list[str], num_hidden_layers: int) -> None:
    """Missing parameters of the MTP layer: a checkpoint that declares it but does not hold its weights (some
    redistributions strip them). Raised before the generic missing-weights error, with the names to look for."""
    absent = [name for name in missing if name.startswith("mtp.")]
    if absent:
        raise ValueError(
            f"speculative_config method 'mtp': the checkpoint declares num_nextn_predict_layers but lacks "
            f"{len(absent)} of its layer's weights (model.layers.{num_hidden_layers}.* in DeepSeek-V3's layout, "
            f"mtp.0.* in DeepSeek-V4's; e.g. {absent[0]!r} as loaded); use a checkpoint that ships them, or method "
            "'ngram'"
        )

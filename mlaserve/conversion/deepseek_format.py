"""A converted Llama/Mistral written in the DeepSeek-V2 config format (`mlaserve convert --format deepseek_v2`), so
transformers' DeepseekV2ForCausalLM loads it as well as this engine's DeepSeek path.

Every converted layer must have the same latent rank and no layer may be skipped (DeepSeek-V2 has one kv_lora_rank
and one cache row for all layers). Per layer, with H query heads, Hkv KV heads of D features, r rotary pairs kept
per KV head (conversion/mla.py), basis U (the identity when exact):
- the shared rope key (qk_rope_head_dim = Hkv * 2r) holds every KV head's kept pairs, interleaved as DeepSeek rotates
  them; each query head's rope query fills its KV group's slot and is zero in the others. Each pair keeps its own
  frequency: the longrope factors give DeepSeek's rotary exactly the kept pairs' frequencies;
- kv_lora_rank = R, c = U^T [k_nope; v]; kv_b_proj holds, per query head, its KV group's rows of U;
- DeepSeek normalises the latent (kv_a_layernorm, eps 1e-6) where this conversion does not. The latent is scaled
  down by alpha so far that its mean square stays below 1e-8 of that eps for any input the layer can get (bounded
  from the weights: the attention input is RMS-normalised), where the norm is linear to 5e-9; the norm's weight
  sqrt(eps) / alpha scales it back. So the exported model is the converted one up to that 5e-9, not a new loss;
- DeepSeek scales scores by (qk_nope + qk_rope)^-0.5: the queries are scaled so the product is the original D^-0.5.
Refused: attention biases (DeepSeek-V2's q_proj has none), sliding windows, rope types whose cos/sin carry an
attention factor (yarn), per-layer ranks and skipped layers (the mlaserve format serves those).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlaserve.loader.safetensors_reader import iter_safetensors

NORM_EPS = 1e-6  # DeepSeek-V2's kv_a_layernorm eps (transformers and DeepSeek's code fix it)
HEADROOM = 1e-8  # the latent's mean square, at most, as a share of NORM_EPS


def check_exportable(hf_config: object, model: object) -> list[str]:
    """Why this converted model cannot be written in the DeepSeek-V2 format (empty when it can)."""
    problems = []
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "model_type", "") == "qwen2":
        problems.append("attention biases (DeepSeek-V2's q_proj has none)")
    window = getattr(hf_config, "sliding_window", None)
    if window and window < getattr(hf_config, "max_position_embeddings", 0):
        problems.append(f"a sliding window of {window}")
    layers = [layer.self_attn for layer in model.model.layers]
    if not all(attn.enable_mla for attn in layers):
        problems.append("skipped layers (mla_skip_layers)")
    elif (
        len({attn.attn.latent_dim for attn in layers}) != 1
        or len({attn.attn.pairs.shape[1] for attn in layers}) != 1
    ):
        problems.append("ranks that differ between layers")
    if layers and layers[0].enable_mla and layers[0].attn.rotary.scaling != 1.0:
        problems.append("a rope type whose cos/sin carry an attention factor")
    return problems


def export_deepseek_v2(src: Path, dst: Path, model: object, hf_config: object, original: dict) -> dict:
    """Write DST: config.json in the DeepSeek-V2 format and the converted weights, from SRC's checkpoint and the
    conversion held by `model` (the engine's converted Llama). Returns the new config."""
    problems = check_exportable(hf_config, model)
    if problems:
        raise ValueError(
            "cannot write the DeepSeek-V2 format: " + "; ".join(problems) + " (use --format mlaserve)"
        )
    weights = dict(iter_safetensors(src))
    attn0 = model.model.layers[0].self_attn.attn
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    pairs_per_head, nope = attn0.pairs.shape[1], attn0.nope_per_head
    rope = kv_heads * 2 * pairs_per_head
    rank = attn0.latent_dim
    tensors: dict[str, torch.Tensor] = {}
    inv_freq = None
    for i, layer in enumerate(model.model.layers):
        attn, prefix = layer.self_attn.attn, f"model.layers.{i}.self_attn."
        wq, wk, wv = (weights[prefix + f"{n}_proj.weight"].float() for n in ("q", "k", "v"))
        parts = _layer(attn, wq, wk, wv, heads, kv_heads, head_dim, rope, nope, rank, weights, i, hf_config)
        layer_freq = attn.rotary.inv_freq.float().cpu()[attn.pairs.cpu()].flatten()  # [Hkv * r], slot order
        if inv_freq is None:
            inv_freq = layer_freq
        elif not torch.equal(inv_freq, layer_freq):
            raise ValueError("cannot write the DeepSeek-V2 format: layers keep different rotary pairs")
        for name, tensor in parts.items():
            tensors[prefix + name] = tensor
        tensors[prefix + "o_proj.weight"] = weights[prefix + "o_proj.weight"]
    for name, tensor in weights.items():
        if ".self_attn." not in name:
            tensors[name] = tensor
    dtype = next(iter(weights.values())).dtype
    tensors = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
    config = _config(original, heads, head_dim, rope, nope, rank, inv_freq)
    dst.mkdir(parents=True, exist_ok=True)  # convert_folder checked it is new or empty
    for item in src.iterdir():  # the tokenizer and generation config; not the weights or the config
        if (
            item.is_file()
            and item.suffix != ".safetensors"
            and item.name not in ("config.json",)
            and not item.name.endswith(".index.json")
        ):
            shutil.copy2(item, dst / item.name)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def _layer(attn, wq, wk, wv, heads, kv_heads, head_dim, rope, nope, rank, weights, index, hf_config) -> dict:
    half = attn.rotary.rotary_dim // 2
    pairs, nope_index = attn.pairs.cpu(), attn.nope_index.cpu()
    groups = heads // kv_heads
    wq, wk, wv = (
        wq.view(heads, head_dim, -1),
        wk.view(kv_heads, head_dim, -1),
        wv.view(kv_heads, head_dim, -1),
    )

    def interleave(w: torch.Tensor, g: int) -> torch.Tensor:  # [2r, hidden]: pairs (a, b) side by side
        a, b = w[pairs[g]], w[pairs[g] + half]
        return torch.stack((a, b), dim=1).flatten(0, 1)

    k_rope = torch.cat([interleave(wk[g], g) for g in range(kv_heads)])  # [rope, hidden]
    y = torch.cat(
        [wk[g][nope_index[g]] for g in range(kv_heads)] + [wv.flatten(0, 1)]
    )  # [Hkv*nope + Hkv*D, hidden]
    basis = torch.eye(y.shape[0]) if attn.basis is None else attn.basis.float().cpu()
    w_c = basis.t() @ y  # [R, hidden]
    alpha = _alpha(w_c, weights, index, hf_config)
    q_scale = math.sqrt(nope + rope) / math.sqrt(head_dim)
    q_rows, kv_b_rows = [], []
    for h in range(heads):
        g = h // groups
        q_pe = torch.zeros(rope, wq.shape[-1])
        slot = 2 * pairs.shape[1]
        q_pe[g * slot : (g + 1) * slot] = interleave(wq[h], g)
        q_rows.append(torch.cat((wq[h][nope_index[g]], q_pe)) * q_scale)
        k_block = basis[g * nope : (g + 1) * nope]  # [nope, R]
        v_start = kv_heads * nope + g * head_dim
        kv_b_rows.append(torch.cat((k_block, basis[v_start : v_start + head_dim])))
    return {
        "q_proj.weight": torch.cat(q_rows),
        "kv_a_proj_with_mqa.weight": torch.cat((alpha * w_c, k_rope)),
        "kv_a_layernorm.weight": torch.full((rank,), math.sqrt(NORM_EPS) / alpha),
        "kv_b_proj.weight": torch.cat(kv_b_rows),
    }


def _alpha(w_c: torch.Tensor, weights: dict, index: int, hf_config: object) -> float:
    """The latent's scale: its mean square at most HEADROOM * NORM_EPS for any normalised input. The attention input
    is RMSNorm(x) * w, so |input| <= sqrt(hidden) * max|w|, and |c| <= sigma_max(W_c) * |input|."""
    norm = weights[f"model.layers.{index}.input_layernorm.weight"].float().abs().max().item()
    bound = torch.linalg.matrix_norm(w_c, ord=2).item() * math.sqrt(w_c.shape[1]) * norm
    mean_square = bound**2 / w_c.shape[0]
    return math.sqrt(HEADROOM * NORM_EPS / max(mean_square, 1e-30))


def _config(
    original: dict, heads: int, head_dim: int, rope: int, nope: int, rank: int, inv_freq: torch.Tensor
) -> dict:
    params = original.get("rope_parameters") or original.get("rope_scaling") or {}
    base = float(params.get("rope_theta", original.get("rope_theta", 10000.0)))
    exponents = torch.arange(0, rope, 2, dtype=torch.float64) / rope
    # longrope: inv_freq_j = 1 / (factor_j * base^(2j / dim)); the factors give each slot its kept pair's frequency
    factors = (1.0 / (inv_freq.double() * base**exponents)).tolist()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "rms_norm_eps", "hidden_act",
            "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            "initializer_range")  # fmt: skip
    config = {name: original[name] for name in keep if name in original}
    config.update(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        num_attention_heads=heads,
        num_key_value_heads=heads,  # every head reads the whole latent
        q_lora_rank=None,
        kv_lora_rank=rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=head_dim,
        # every layer a dense MLP, as the source's (the MoE fields keep DeepSeek-V2's defaults and go unused)
        first_k_dense_replace=original["num_hidden_layers"],
        attention_bias=False,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": base,
            "short_factor": factors,
            "long_factor": factors,
            "factor": 1.0,  # no context extension: the short factors apply at every length
            "attention_factor": 1.0,
        },
        torch_dtype=original.get("torch_dtype", original.get("dtype", "float32")),
    )
    return config

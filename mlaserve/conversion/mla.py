"""GQA/MHA -> MLA conversion at reduced rank, training-free, from calibration activations (our own take on the
methods of TransMLA, arXiv 2502.07864, and MHA2MLA, arXiv 2502.14837).

For every layer, from the original model's queries, keys and values on calibration text:
1. Partial rotary: each KV head keeps the `qk_rope_head_dim / 2` rotary pairs that carry the most of its attention
   scores, scored as MHA2MLA's 2-norm criterion does (the mean norm of the key's pair times the mean norm of its
   query heads' pair); the other pairs lose their rotation and become "nope" features.
2. Low-rank latent: the nope key features and the values of all KV heads, [k_nope; v], are projected on their top
   `kv_lora_rank` principal directions over the calibration tokens (uncentred, so a bias passes through), which
   become the up-projections.
The cache then holds kv_lora_rank + num_kv_heads * qk_rope_head_dim values per token and layer instead of
2 * num_kv_heads * head_dim. Both steps change the model's answers (the rotation removal most: MHA2MLA fine-tunes
after it); benchmarks/quality.py measures by how much.
"""

import logging

import torch

from mlaserve.attention.metadata import build_metadata
from mlaserve.kvcache.allocate import allocate_kv_caches
from mlaserve.layers.latent_gqa import LatentGQA, gather_features, nope_features

logger = logging.getLogger(__name__)

CALIBRATION_TEXT = "pydoc_data.topics (Python standard library), topics in reverse name order"


def calibration_text() -> str:
    """Text on every machine: the standard library's documentation topics, last topic first (the quality harness
    reads them first topic first, so a short calibration slice and its evaluation text do not overlap)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics, reverse=True))


def latent_layers(model: torch.nn.Module) -> list[LatentGQA]:
    return [m for m in model.modules() if isinstance(m, LatentGQA)]


@torch.no_grad()
def capture(model, ids: list[int], block_size: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Each latent layer's (q, k, v) before rotation for one forward pass over `ids` (a temporary cache)."""
    layers = latent_layers(model)
    n = len(ids)
    blocks = -(-n // block_size)
    dtype = next(model.parameters()).dtype
    caches = allocate_kv_caches(model.kv_cache_spec(), blocks + 1, block_size, dtype, device)
    table = torch.arange(1, blocks + 1, dtype=torch.int32, device=device)[None]
    slots = torch.arange(n, device=device) + block_size  # block 0 is the null block
    meta = build_metadata(block_size, table, [n], [n], 0, slots)
    for layer in layers:
        layer.capture = []
    try:
        model(torch.tensor(ids, device=device), torch.arange(n, device=device), caches, meta)
        return [layer.capture[0] for layer in layers]
    finally:
        for layer in layers:
            layer.capture = None


def pair_scores(q: torch.Tensor, k: torch.Tensor, half: int) -> torch.Tensor:
    """[Hkv, half]: per KV head and rotary pair (i, i + half), mean |k pair| x mean over its query heads of
    mean |q pair| (rotation keeps a pair's norm, so unrotated activations give the same scores)."""

    def norms(x: torch.Tensor) -> torch.Tensor:  # [T, heads, half]
        return torch.sqrt(x[..., :half].float() ** 2 + x[..., half : 2 * half].float() ** 2).mean(0)

    hkv = k.shape[1]
    return norms(k) * norms(q).view(hkv, -1, half).mean(1)


def principal_basis(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """[features, rank]: the top-`rank` eigenvectors of rows^T rows (rows [N, features]), float32."""
    x = rows.double()
    values, vectors = torch.linalg.eigh(x.t() @ x)
    return vectors[:, values.argsort(descending=True)[:rank]].float()


def convert_layer(
    layer: LatentGQA, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, rope: int
) -> None:
    half = layer.rotary.rotary_dim // 2
    pairs = pair_scores(q, k, half).topk(rope // 2, dim=-1).indices.sort(dim=-1).values
    k_nope = gather_features(k, nope_features(pairs, layer.head_dim, half))
    rows = torch.cat((k_nope.flatten(1), v.flatten(1)), dim=-1)
    basis = None if rank >= rows.shape[1] else principal_basis(rows, rank)
    layer.convert(pairs, basis)


def check_options(hf_config: object, kv_lora_rank: int | None, qk_rope_head_dim: int | None) -> None:
    """A rank or rotary width the model's layers cannot take is an error before any weight loads."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rotary = int(head_dim * getattr(hf_config, "partial_rotary_factor", 1.0))
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    if qk_rope_head_dim is not None and (
        qk_rope_head_dim < 2 or qk_rope_head_dim % 2 or qk_rope_head_dim > rotary
    ):
        raise ValueError(
            f"qk_rope_head_dim={qk_rope_head_dim}: rotary features kept per KV head must be an even number from 2 "
            f"to the model's rotary width {rotary}"
        )
    rope = rotary if qk_rope_head_dim is None else qk_rope_head_dim
    most = kv_heads * (head_dim - rope + head_dim)
    if kv_lora_rank is not None and not 1 <= kv_lora_rank <= most:
        raise ValueError(
            f"mla_latent_dim (kv_lora_rank)={kv_lora_rank}: the latent of a layer holds at most the nope keys and "
            f"values of its {kv_heads} KV heads, {most} features with qk_rope_head_dim={rope}"
        )


def convert_model(
    model: torch.nn.Module,
    kv_lora_rank: int | None,
    qk_rope_head_dim: int | None,
    ids: list[int],
    block_size: int,
    device: torch.device,
) -> str:
    """Converts every latent layer of `model` (built with enable_mla: exact) at the given rank and rotary width;
    returns what it did, for the log."""
    layers = latent_layers(model)
    before = sum(layer.latent_dim + layer.rope_dim for layer in layers)
    activations = capture(model, ids, block_size, device)
    for layer, (q, k, v) in zip(layers, activations, strict=True):
        rope = layer.rotary.rotary_dim if qk_rope_head_dim is None else qk_rope_head_dim
        rank = kv_lora_rank or layer.num_kv_heads * (layer.head_dim - rope + layer.head_dim)
        convert_layer(layer, q, k, v, rank, rope)
    after = sum(layer.latent_dim + layer.rope_dim for layer in layers)
    first = layers[0]
    return (
        f"MLA conversion: {len(layers)} layers at kv_lora_rank {first.latent_dim}, qk_rope_head_dim "
        f"{first.rope_per_head} per KV head ({first.num_kv_heads} KV heads); KV values per token {before} -> {after} "
        f"({100 * (1 - after / before):.1f}% less); calibration: {len(ids)} tokens of {CALIBRATION_TEXT}"
    )

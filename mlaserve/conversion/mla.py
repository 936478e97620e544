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
from collections.abc import Sequence

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


def principal_directions(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues, eigenvectors) of rows^T rows (rows [N, features]), largest first, in float64."""
    x = rows.double()
    values, vectors = torch.linalg.eigh(x.t() @ x)
    order = values.argsort(descending=True)
    return values[order].clamp_min(0), vectors[:, order]


def principal_basis(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """[features, rank]: the top-`rank` eigenvectors of rows^T rows (rows [N, features]), float32."""
    return principal_directions(rows)[1][:, :rank].float()


def allocate_ranks(spectra: list[torch.Tensor], total: int, least: int = 1) -> list[int]:
    """Ranks per layer summing to `total` that keep the most of each layer's latent energy, relative to that
    layer's own (each spectrum is a layer's eigenvalues, largest first): the `total` largest shares over all layers,
    with at least `least` per layer. A layer whose keys and values lie in few directions gives its rank to one
    whose do not; the sum of the relative residuals is the smallest any split of `total` reaches."""
    shares = [s / s.sum().clamp_min(1e-30) for s in spectra]
    ranks = [min(least, len(s)) for s in shares]
    if total < sum(ranks) or total > sum(len(s) for s in shares):
        raise ValueError(
            f"a latent budget of {total} cannot be split over {len(shares)} layers of at most "
            f"{[len(s) for s in shares]} features with at least {least} each"
        )
    rest = [(float(value), i) for i, s in enumerate(shares) for value in s[ranks[i] :]]
    rest.sort(key=lambda item: -item[0])
    for _, i in rest[: total - sum(ranks)]:
        ranks[i] += 1  # the spectra are sorted, so each layer's picks are its next largest shares
    return ranks


def _layer_rows(
    layer: LatentGQA, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rotary pairs each KV head keeps, the rows [k_nope; v] its latent is fitted to)."""
    half = layer.rotary.rotary_dim // 2
    pairs = pair_scores(q, k, half).topk(rope // 2, dim=-1).indices.sort(dim=-1).values
    k_nope = gather_features(k, nope_features(pairs, layer.head_dim, half))
    return pairs, torch.cat((k_nope.flatten(1), v.flatten(1)), dim=-1)


def convert_layer(
    layer: LatentGQA, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, rope: int
) -> None:
    pairs, rows = _layer_rows(layer, q, k, v, rope)
    basis = None if rank >= rows.shape[1] else principal_basis(rows, rank)
    layer.convert(pairs, basis)


def check_options(
    hf_config: object,
    kv_lora_rank: int | Sequence[int] | None,
    qk_rope_head_dim: int | None,
    num_latent_layers: int | None = None,
) -> None:
    """A rank or rotary width the model's layers cannot take is an error before any weight loads. Per-layer ranks
    (a sequence) give one rank per converted layer (every layer not in mla_skip_layers, in order)."""
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
    ranks = (
        []
        if kv_lora_rank is None
        else [kv_lora_rank]
        if isinstance(kv_lora_rank, int)
        else list(kv_lora_rank)
    )
    if (
        not isinstance(kv_lora_rank, int | None)
        and num_latent_layers is not None
        and len(ranks) != num_latent_layers
    ):
        raise ValueError(
            f"mla_latent_dim: {len(ranks)} per-layer ranks for {num_latent_layers} converted layers; give one per "
            "layer (skipped layers excluded) or a single rank"
        )
    for rank in ranks:
        if not 1 <= rank <= most:
            raise ValueError(
                f"mla_latent_dim (kv_lora_rank)={rank}: the latent of a layer holds at most the nope keys and "
                f"values of its {kv_heads} KV heads, {most} features with qk_rope_head_dim={rope}"
            )


def convert_model(
    model: torch.nn.Module,
    kv_lora_rank: int | Sequence[int] | None,
    qk_rope_head_dim: int | None,
    ids: list[int],
    block_size: int,
    device: torch.device,
    allocation: str = "uniform",
) -> str:
    """Converts every latent layer of `model` (built with enable_mla: exact) at the given rotary width and rank:
    one rank for all, one per layer, or (allocation "error") the budget of one rank per layer split by
    allocate_ranks. Returns what it did, for the log."""
    layers = latent_layers(model)
    before = sum(layer.latent_dim + layer.rope_dim for layer in layers)
    fitted = []
    for layer, (q, k, v) in zip(layers, capture(model, ids, block_size, device), strict=True):
        rope = layer.rotary.rotary_dim if qk_rope_head_dim is None else qk_rope_head_dim
        fitted.append(_layer_rows(layer, q, k, v, rope))
    full = [rows.shape[1] for _, rows in fitted]
    if kv_lora_rank is None:
        ranks = full
    elif isinstance(kv_lora_rank, int):
        ranks = [kv_lora_rank] * len(layers)
    else:
        ranks = list(kv_lora_rank)
    directions = [principal_directions(rows) for _, rows in fitted] if ranks != full else None
    if allocation == "error" and directions is not None:
        ranks = allocate_ranks([values for values, _ in directions], sum(ranks))
    for i, (layer, (pairs, _)) in enumerate(zip(layers, fitted, strict=True)):
        basis = None if ranks[i] >= full[i] else directions[i][1][:, : ranks[i]].float()
        layer.convert(pairs, basis)
    after = sum(layer.latent_dim + layer.rope_dim for layer in layers)
    first = layers[0]
    shown = f"kv_lora_rank {ranks[0]}" if len(set(ranks)) == 1 else f"kv_lora_rank per layer {ranks}"
    return (
        f"MLA conversion: {len(layers)} layers at {shown} ({allocation}), qk_rope_head_dim "
        f"{first.rope_per_head} per KV head ({first.num_kv_heads} KV heads); KV values per token {before} -> {after} "
        f"({100 * (1 - after / before):.1f}% less); calibration: {len(ids)} tokens of {CALIBRATION_TEXT}"
    )

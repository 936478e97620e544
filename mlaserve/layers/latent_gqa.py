"""GQA/MHA attention written as MLA (`enable_mla=True`), served from the paged latent cache by the MLA code path.

Each token caches one row [latent c (R) | rope key (Hkv x P)]:
- the rope key is every KV head's rotated key features, side by side; head h's rope query is its rotated query
  features in its KV group's slice, zero in the others;
- the latent is the rest of the keys (their "nope" features) and all the values, as c = U^T [k_nope; v] for an
  orthonormal basis U; the up-projections are U's rows (W_UK for k_nope, W_UV for v, per KV group).

Exact conversion (no rank given: TransMLA's first step): every rotary pair stays rotated (P = the head's rotary
width), there are no nope key features but those the model never rotates, and U is the identity: the row is GQA's
K and V side by side, scores and outputs are GQA's exactly, and the cache costs what it did.

Compressed conversion (`convert`, from calibration activations; conversion/mla.py): each KV head keeps the rotary
pairs that carry most of the attention score (MHA2MLA's 2-norm criterion), the rest lose their rotation and join
the nope features, and U is the top-R principal directions of [k_nope; v] over calibration text: lossy by design,
training-free (benchmarks/quality.py measures it).

Absorbed decode reads the rows in place (backend.decode_latent); prefill expands them back to per-head K/V and runs
the backend's GQA prefill.
"""

import torch
from torch import nn

from mlaserve.attention.backend import AttentionBackend, write_to_cache
from mlaserve.attention.metadata import AttentionMetadata
from mlaserve.kvcache.quant import is_quantized, quantize_rows
from mlaserve.layers.rotary import RotaryEmbedding


def nope_features(pairs: torch.Tensor, head_dim: int, half: int) -> torch.Tensor:
    """[heads, head_dim - 2r]: each head's features outside its kept rotary pairs [heads, r] (pair i is features i
    and i + half), in order."""
    keep = torch.ones(pairs.shape[0], head_dim, dtype=torch.bool, device=pairs.device)
    keep.scatter_(1, pairs, False)
    keep.scatter_(1, pairs + half, False)
    return keep.nonzero()[:, 1].view(pairs.shape[0], -1)


def gather_features(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> [T, heads, n]: each head's features at index [heads, n]."""
    return x.gather(2, index[None].expand(x.shape[0], -1, -1))


class LatentGQA(nn.Module):
    def __init__(
        self,
        backend: AttentionBackend,
        scale: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.backend, self.scale, self.rotary = backend, scale, rotary
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        half = rotary.rotary_dim // 2
        # Exact: every rotary pair (i, i + rotary_dim / 2) of every KV head kept, in order; no basis (U = I).
        self.register_buffer(
            "pairs", torch.arange(half).expand(num_kv_heads, half).contiguous(), persistent=False
        )
        # Integer indices and an identity, not boolean masks or index_put: decode steps are captured in CUDA graphs.
        self.register_buffer("kv_eye", torch.eye(num_kv_heads), persistent=False)
        # An orthonormal basis U [Hkv * nope + Hkv * D, R] of [k_nope; v] (its rows: W_UK, then W_UV; c = y @ U),
        # set by convert; None: the identity (exact).
        self.basis: torch.Tensor | None = None
        self._set_dims()
        self.cache_group = 0  # set by the engine (CausalLM.set_cache_groups)
        self.capture: list | None = None  # calibration: (q, k, v) before rotation, appended by forward

    def _set_dims(self) -> None:
        hkv, d = self.num_kv_heads, self.head_dim
        self.nope_index = nope_features(self.pairs, d, self.rotary.rotary_dim // 2)
        self.rope_per_head = 2 * self.pairs.shape[1]
        self.nope_per_head = d - self.rope_per_head
        self.rope_dim = hkv * self.rope_per_head
        full = hkv * (self.nope_per_head + d)
        self.latent_dim = full if self.basis is None else self.basis.shape[1]

    def convert(self, pairs: torch.Tensor, basis: torch.Tensor | None) -> None:
        """Keep rotary `pairs` [Hkv, r] (indices below rotary_dim / 2) and cache c = [k_nope; v] @ basis."""
        self.pairs = pairs.to(self.pairs.device)
        self.basis = None if basis is None else basis.to(self.pairs.device)
        self._set_dims()

    def _split(self, x: torch.Tensor, positions: torch.Tensor, pairs: torch.Tensor, nope: torch.Tensor):
        """x [T, heads, D] -> (rotated kept pairs [T, heads, 2r] as (a | b) halves, the other features [T, heads,
        D - 2r]); pairs [heads, r] and nope [heads, D - 2r] index each head's features."""
        half, t = self.rotary.rotary_dim // 2, x.shape[0]
        idx = pairs[None].expand(t, -1, -1)
        a, b = x.gather(2, idx), x.gather(2, idx + half)
        cos, sin = self.rotary.cos_sin(positions)  # [T, half]: each head takes its kept pairs' frequencies
        cos, sin = cos[:, pairs].to(x.dtype), sin[:, pairs].to(x.dtype)
        rope = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        return rope, gather_features(x, nope)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D], none rotated yet; kv_cache [blocks, page, 1, R + Hkv * P]."""
        if self.capture is not None:
            self.capture.append((q.detach(), k.detach(), v.detach()))
        meta = meta.for_group(self.cache_group)
        groups = self.num_heads // self.num_kv_heads
        q_rope, q_nope = self._split(
            q,
            positions,
            self.pairs.repeat_interleave(groups, 0),
            self.nope_index.repeat_interleave(groups, 0),
        )
        k_rope, k_nope = self._split(k, positions, self.pairs, self.nope_index)
        latent = torch.cat((k_nope.flatten(1), v.flatten(1)), dim=-1)
        if self.basis is not None:
            latent = (latent.float() @ self.basis.float()).to(latent.dtype)
        rows = torch.cat((latent, k_rope.flatten(1)), dim=-1).unsqueeze(1)
        write_to_cache(
            kv_cache,
            meta.slot_mapping,
            quantize_rows(rows, kv_cache.dtype) if is_quantized(kv_cache.dtype) else rows,
        )
        nd, parts = meta.num_decodes, []
        if nd:
            parts.append(self._decode(q_rope[:nd], q_nope[:nd], kv_cache, meta))
        if nd < meta.num_seqs:
            parts.append(self._prefill(q_rope[nd:], q_nope[nd:], kv_cache, meta))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] as [T, Hkv, H / Hkv, ...]: the query heads of each KV head."""
        return x.view(x.shape[0], self.num_kv_heads, self.num_heads // self.num_kv_heads, *x.shape[2:])

    def _split_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the latent space [S, R] as (k_nope [S, Hkv, nope], v [S, Hkv, D]): through the basis, or (exact)
        the latent's own slices."""
        s, hkv, nope = latent.shape[0], self.num_kv_heads, self.nope_per_head
        full = latent if self.basis is None else (latent.float() @ self.basis.t().float()).to(latent.dtype)
        return full[:, : hkv * nope].view(s, hkv, nope), full[:, hkv * nope :].reshape(s, hkv, self.head_dim)

    def _decode(self, q_rope, q_nope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, hkv = q_rope.shape[0], self.num_kv_heads
        eye = self.kv_eye.to(q_rope.dtype)
        # head h's rope query: its rotated features in its KV group's slice of the rope key, zero in the others
        q_pe = torch.einsum("tgjp,gk->tgjkp", self._groups(q_rope), eye)
        # the key up-projection absorbed into the query: its nope features in its group's slice of [k_nope; v]
        q_nope_slices = torch.einsum("tgjn,gk->tgjkn", self._groups(q_nope), eye).flatten(3)
        zeros = q_nope_slices.new_zeros(*q_nope_slices.shape[:3], hkv * self.head_dim)
        q_full = torch.cat((q_nope_slices, zeros), dim=-1)
        q_latent = q_full if self.basis is None else (q_full.float() @ self.basis.float()).to(q_rope.dtype)
        out = self.backend.decode_latent(
            q_latent.reshape(t, self.num_heads, self.latent_dim),
            q_pe.reshape(t, self.num_heads, self.rope_dim),
            kv_cache,
            meta,
            self.scale,
            self.latent_dim,
        )
        # the value up-projection: each head's own KV group's values out of the attended latent
        full = out if self.basis is None else (out.float() @ self.basis.t().float()).to(out.dtype)
        values = self._groups(full[..., hkv * self.nope_per_head :]).unflatten(-1, (hkv, self.head_dim))
        values = torch.einsum("tgjkd,gk->tgjd", values, eye.to(values.dtype))
        return values.reshape(t, self.num_heads, self.head_dim)

    def _prefill(self, q_rope, q_nope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        context = self.backend.gather_prefill_context(kv_cache, meta, q_rope.dtype)[:, 0]  # [S, R + rope]
        latent, k_rope = context.split([self.latent_dim, self.rope_dim], dim=-1)
        k_nope, v = self._split_latent(latent)
        k = torch.cat(
            (k_rope.reshape(context.shape[0], self.num_kv_heads, self.rope_per_head), k_nope), dim=-1
        )
        return self.backend.prefill(torch.cat((q_rope, q_nope), dim=-1), k, v.contiguous(), meta, self.scale)

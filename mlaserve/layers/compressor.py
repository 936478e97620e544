"""DeepSeek-V4's KV compressor and its lightning indexer over the compressed entries (torch reference).

A compressor folds every `rate` tokens ("window" w: positions w*rate .. (w+1)*rate - 1) into one entry: a softmax
over the window, per feature, of the tokens' gate projections plus a learned per-slot bias weights their kv
projections, and the weighted sum is normed and rotated at position w*rate. With `overlap` (compressed-sparse
layers) each token projects two series: entry w pools the first series of window w - 1 and the second series of
window w, so entries span 2 * rate tokens at a stride of rate (window 0's missing half has zero weight).

The engine caches each token's kv and gate projections (`state`) in its window group, so an entry is a pure
function of cached rows: `pool` makes it, once, from the rows of the `rate` (with overlap, 2 x rate) tokens up to its
last, in the step that computes that token, and the entry is cached in a group of its own (models/deepseek_v4.py).
That is the reference's value exactly, whatever the chunking of prefill, the batching or the prefix-cache hits,
since the reference emits each entry from the same projections once its window is complete. `entries`, which makes
every entry of a sequence from all its rows at once, is the slow reference `pool` is tested against. An entry is
visible to query position t once its window is complete: w < (t+1)//rate.

The indexer compresses its own narrower series the same way and scores each query against the entries:
sum over its heads of weight[h] * relu(q[h] . key) * index_head_dim^-0.5; a query keeps its index_topk best.
"""

import torch
from torch import nn

from mlaserve.config.quantization import BlockFP8Config
from mlaserve.layers.linear import ReplicatedLinear
from mlaserve.layers.norm import Float32RMSNorm
from mlaserve.layers.rotary import rotate_trailing_pairs


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        # DeepSeek's checkpoint names: wkv / wgate the kv and gate projections, ape the per-slot gate bias
        self.wkv = nn.Linear(hidden_size, width, bias=False)
        self.wgate = nn.Linear(hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.empty(rate, width, dtype=torch.float32))
        self.norm = Float32RMSNorm(dim, eps)

    @property
    def state_width(self) -> int:
        """Features each token caches for this compressor: its kv projection, then its gate projection."""
        return 2 * self.wkv.out_features

    def state(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.wkv(hidden), self.wgate(hidden)), dim=-1)

    def entries(self, states: torch.Tensor, count: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The first `count` entries [count, dim] from a sequence's cached states [>= count * rate, state_width];
        cos/sin of positions w * rate (the compressed rotary)."""
        r, d, width = self.rate, self.dim, self.wkv.out_features
        kv = states[: count * r, :width].reshape(count, r, width)
        gate = states[: count * r, width:].reshape(count, r, width) + self.ape  # float32, as the reference
        if self.overlap:
            both_kv = kv.new_zeros(count, 2 * r, d)
            both_gate = gate.new_full((count, 2 * r, d), float("-inf"))
            both_kv[:, r:], both_gate[:, r:] = kv[..., d:], gate[..., d:]
            both_kv[1:, :r], both_gate[1:, :r] = kv[:-1, :, :d], gate[:-1, :, :d]
            kv, gate = both_kv, both_gate
        pooled = self.norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        return rotate_trailing_pairs(pooled[:, None], cos, sin)[:, 0]

    def pool(
        self, windows: torch.Tensor, valid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Entries [E, dim], each from the cached states [E, >= span, state_width] of the tokens up to its last (span
        = rate; with overlap, 2 x rate: the window before it, then its own); valid [E, >= span] False before the
        sequence's start; cos/sin at each entry's first position."""
        r, d, width = self.rate, self.dim, self.wkv.out_features
        span = 2 * r if self.overlap else r
        windows, valid = windows[:, -span:], valid[:, -span:, None]
        kv, gate = windows[..., :width], windows[..., width:] + self.ape.repeat(span // r, 1)  # float32
        if self.overlap:  # the earlier window's first series, then this window's second
            kv = torch.cat((kv[:, :r, :d], kv[:, r:, d:]), dim=1)
            gate = torch.cat((gate[:, :r, :d], gate[:, r:, d:]), dim=1)
        # The lowest finite gate, not -inf: a row with no token at all (a captured step's padding row) pools zeros
        # instead of writing NaN to the null block, which a later step's masked reads would carry.
        kv, gate = kv.masked_fill(~valid, 0), gate.masked_fill(~valid, torch.finfo(gate.dtype).min)
        pooled = self.norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        return rotate_trailing_pairs(pooled[:, None], cos, sin)[:, 0]


class CompressedIndexer(nn.Module):
    """The lightning indexer of a compressed-sparse layer: its own overlapping compressor at index_head_dim, and
    queries from the attention's low-rank query path."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        rate: int,
        topk: int,
        eps: float,
        quant: BlockFP8Config | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = num_heads, head_dim, topk
        self.compressor = Compressor(hidden_size, head_dim, rate, True, eps)
        # FP8 in a block-FP8 checkpoint; the compressors and weights_proj ship unquantized
        self.wq_b = (
            nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
            if quant is None
            else ReplicatedLinear(q_lora_rank, num_heads * head_dim, quant=quant)
        )
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def queries(
        self, q_resid: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries [T, heads, head_dim], rotated at their positions, and their heads' weights [T, heads]
        float32 (each score is the weighted sum over heads of relu(q . key) x head_dim^-0.5)."""
        q = self.wq_b(q_resid).view(q_resid.shape[0], self.num_heads, self.head_dim)
        return rotate_trailing_pairs(q, cos, sin), self.weights_proj(hidden).float() * self.num_heads**-0.5

    def select(
        self,
        q_resid: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """[T, E] True where a query keeps an entry: its top-k visible entries by index score. q_resid [T, q_lora],
        hidden [T, hidden], cos/sin of the queries' positions, keys [E, head_dim] (one sequence's entries) or
        [T, E, head_dim] (each query's own), visible [T, E]."""
        q, weights = self.queries(q_resid, hidden, cos, sin)
        keys = keys.expand(q.shape[0], -1, -1) if keys.dim() == 2 else keys
        scores = torch.relu(torch.einsum("thd,ted->the", q.float(), keys.float())) * self.head_dim**-0.5
        scores = (scores * weights[..., None]).sum(dim=1).masked_fill(~visible, float("-inf"))
        best = scores.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(1, best, True) & visible

"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual stream is hc_mult parallel streams.

Before a block, a learned projection of all streams gives three weightings: `pre` collapses the streams into the
block's input, `post` spreads the block's output back over them, and `comb` (made doubly stochastic by
Sinkhorn-Knopp iterations, so mixing never grows the streams' norm) mixes the incoming streams into the outgoing
ones. The head collapses the streams once more before the final norm. All of it runs in float32, as the reference
keeps these weights.
"""

import torch
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    def __init__(
        self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = (
            hc_mult,
            sinkhorn_iters,
            hc_eps,
            norm_eps,
        )
        width = (2 + hc_mult) * hc_mult  # pre (N), post (N), comb (N x N)
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N], comb [T, N, N], the block's input [T, D]), post and comb float32."""
        n = self.hc_mult
        mixes = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps) @ self.fn.float().t()
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The outgoing streams: the block's output spread by post plus the incoming streams mixed by comb (its
        first axis summed: comb^T @ streams)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


class HyperHead(nn.Module):
    """The final collapse of the streams into one hidden state."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps) @ self.hc_fn.float().t()
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

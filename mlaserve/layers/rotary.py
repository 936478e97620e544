"""Rotary position embedding: NeoX (rotate-half) and interleaved-pair layouts, any rope scaling transformers knows.

The frequencies come from transformers' own rope initialisers (default, linear, llama3, yarn, longrope), so the
scaling math is the reference's; "dynamic" NTK rescales with the running length and is not supported.

On CUDA a fused Triton kernel (kernels/rotary.py) replaces the dozen eager kernels of a rotation; `cos_sin` and
`rotate` are the torch definition it is tested against and the CPU path.
"""

import torch
from torch import nn

from mlaserve.kernels.registry import ROTARY


def rope_frequencies(hf_config: object, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2], attention_scaling) for the config's rope_parameters."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
        inv_freq = 1.0 / (base**exponents)
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type 'dynamic' is not supported; supported: default, linear, llama3, yarn, longrope"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unknown rope_type {rope_type!r}; supported: default, {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    with torch.device("cpu"):  # its own tensors: not on the meta device a model is first sized on
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of q and k by their absolute positions.

    interleaved=True rotates pairs (x0, x1), (x2, x3), ... (DeepSeek); False rotates (x_i, x_{i+d/2}) (Llama).
    Attention only sees dot products, so the output layout need not match the reference's, only be the same for
    q and k.
    """

    def __init__(
        self, inv_freq: torch.Tensor, attention_scaling: float = 1.0, interleaved: bool = False
    ) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = inv_freq.numel() * 2
        self.scaling = attention_scaling
        self.interleaved = interleaved

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] with D >= rotary_dim; cos/sin: [T, rotary_dim/2]."""
        d = self.rotary_dim
        rot, rest = x[..., :d], x[..., d:]
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D] (strided views allowed); returns new rotated tensors."""
        rope = (self.inv_freq, self.scaling, self.rotary_dim, self.interleaved)
        kernel = ROTARY.choose(positions, q, k, *rope)
        if kernel is not None:
            return kernel(positions, q, k, *rope)
        cos, sin = self.cos_sin(positions)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    def rotate_heads(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotates one [T, H, D] tensor, e.g. q and k side by side in a fused projection's output."""
        # k with no heads: the kernel's k programs vanish from the grid
        args = (positions, x, x[:, :0], self.inv_freq, self.scaling, self.rotary_dim, self.interleaved)
        kernel = ROTARY.choose(*args)
        if kernel is not None:
            return kernel(*args)[0]
        return self.rotate(x, *self.cos_sin(positions))


def rotate_trailing_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the last 2 * cos.shape[-1] features of x [T, H, D] as interleaved pairs (x0, x1), (x2, x3), ...,
    keeping that layout (DeepSeek-V4 reads the rotated part back as values, so the layout is not free); cos/sin
    [T, rotary_dim / 2], rounded to x's dtype as the reference does, then applied in float32."""
    d = 2 * cos.shape[-1]
    rest, rot = x[..., : x.shape[-1] - d], x[..., x.shape[-1] - d :].float()
    cos, sin = cos[:, None, :].to(x.dtype).float(), sin[:, None, :].to(x.dtype).float()
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((rest, out), dim=-1)

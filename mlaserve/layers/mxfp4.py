"""MXFP4 weights as DeepSeek-V4 publishes its routed experts, in torch: the CPU path and the reference any kernel is
checked against.

A weight [..., N, K] is stored as bytes [..., N, K / 2], two FP4 (e2m1) codes per byte, the even column in the low
nibble and the odd one in the high nibble, with one power-of-two scale per 32 consecutive columns of a row: an e8m0
byte e standing for 2^(e - 127), [..., N, K / 32]. A checkpoint may type the bytes int8, uint8 or
float4_e2m1fn_x2 and the scales uint8 or float8_e8m0fnu; the layers keep both as uint8, since only the bits
matter and uint8 is the one type every torch op and device takes.
"""

import torch

GROUP = 32  # columns sharing one e8m0 scale
FP4_MAX = 6.0
# The 16 e2m1 codes: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_NAN = 255  # the one e8m0 code that is no power of two


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a one-byte tensor (packed FP4 or e8m0 scales, however the checkpoint typed them)."""
    if t.element_size() != 1:
        raise ValueError(f"MXFP4 data must be one byte per element, got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """float32 e2m1 values [..., 2 * K2] of packed bytes [..., K2], low nibble first."""
    b = as_bytes(packed).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return table[codes]


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """float32 2^(e - 127) of e8m0 bytes."""
    return torch.exp2(as_bytes(scales).float() - 127.0)


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [..., N, K] that packed [..., N, K / 2] and scales [..., N, K / 32] stand for."""
    values = unpack(packed)
    k = values.shape[-1]
    return values * scale_values(scales).repeat_interleave(GROUP, dim=-1)[..., :k]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., N, K / 2], e8m0 uint8 [..., N, K / 32]) of a float weight whose K is a multiple of 32:
    each group's scale the smallest power of two that brings its largest magnitude within 6, each value rounded
    to the nearest e2m1 value (for test checkpoints; the published ones come quantized)."""
    *lead, n, k = w.shape
    if k % GROUP:
        raise ValueError(f"MXFP4 needs input widths that are multiples of {GROUP}, got {k}")
    groups = w.float().reshape(*lead, n, k // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / FP4_MAX)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    table = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    magnitude = (scaled.abs()[..., None] - table).abs().argmin(dim=-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).reshape(*lead, n, k)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (exponent + 127).to(torch.uint8).contiguous()

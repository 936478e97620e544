"""The absorbed query as two fp8 (e4m3) terms per head, for decode dots on fp8 tensor cores (mla_decode_fp8.py).

q ≈ hi·a + lo·b over a head's latent and rope parts together: a = max|q| / 448 and hi is q / a rounded to e4m3;
lo is the residual q - hi·a, scaled by its own b = max|residual| / 448. Two e4m3 terms keep about 8 significant bits,
bf16's precision. The kernel splits its heads itself (`mla_decode_fp8._split_queries8`, the same arithmetic); this
is the torch reference, for tests and for reading.
"""

import torch

E4M3_MAX = 448.0


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (float32, |x| <= 448) rounded to an e4m3 value in fp32 arithmetic: a step of 2^-3 times x's leading power
    of two, 2^-9 below 2^-6 (e4m3's subnormals), halves rounded up. Converting the result to e4m3 is then exact,
    and a residual can be taken against it without converting back."""
    lead = torch.clamp(x.view(torch.int32) & 0x7F800000, min=121 << 23)  # biased exponent, at least 2^-6's
    step = (lead - (3 << 23)).view(torch.float32)
    inv_step = ((254 << 23) - lead + (3 << 23)).view(torch.float32)  # powers of two: exact products
    return torch.floor(x * inv_step + 0.5) * step


def split_queries(q: torch.Tensor, q_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, d_lat], q_pe [B, H, d_rope] -> terms [B, H, 2, d_lat + d_rope] e4m3 (hi, then lo; each row latent
    then rope) and scales [B, H, 2] float32 (a, b). A head of zeros gets zero terms and scales of 1."""
    full = torch.cat((q, q_pe), -1).float()
    amax = full.abs().amax(-1, keepdim=True)
    a = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    hi = round_e4m3(full / a)
    rest = full - hi * a
    rmax = rest.abs().amax(-1, keepdim=True)
    b = torch.where(rmax > 0, rmax / E4M3_MAX, torch.ones_like(rmax))
    lo = round_e4m3(rest / b)
    terms = torch.stack((hi, lo), 2).to(torch.float8_e4m3fn)
    return terms, torch.cat((a, b), -1)

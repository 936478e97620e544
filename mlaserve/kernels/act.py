"""SiLU(gate) * up in one Triton launch, for gated MLPs on CUDA (torch spends two kernels and an intermediate).

`gated_act` in activation.py is the reference and the path everywhere else."""

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _silu_and_mul_kernel(X, Out, n, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31 in a long prefill
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    # The reference rounds SiLU(gate) to the input dtype before the multiply; so does this.
    act = (gate / (1.0 + tl.exp(-gate))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * up).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns, then up) -> SiLU(gate) * up, [T, I]."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    x = gate_up.reshape(-1, gate_up.shape[-1])
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] > 0:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
            x, out, n, x.stride(0), out.stride(0), BLOCK=block, **pdl_launch(x)
        )
    return out.reshape(*gate_up.shape[:-1], n)

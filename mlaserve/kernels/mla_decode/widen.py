"""8-bit cache values widened to fp16 by integer operations: the Triton split kernel's widen_bits option and the
widening Gluon kernel's int8 path (gluon_wgmma8.py)."""

import triton
import triton.language as tl


@triton.jit
def widen_bits(x, out_dtype: tl.constexpr):
    """8-bit values -> fp16 by integer operations, off the conversion unit: fp8_e4m3 s.eeee.mmm placed as fp16
    s.0eeee.mmm0000000 is x * 2^-8 (subnormals too); int8 v as fp16 0x6400 | (v + 128) is 1,024 + 128 + v."""
    b = x.to(tl.uint8, bitcast=True).to(tl.uint16)
    if x.dtype == tl.int8:
        return (((b ^ 0x80) | 0x6400).to(tl.float16, bitcast=True) - 1152.0).to(out_dtype)
    return ((((b & 0x7F) << 7) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True) * 256.0).to(out_dtype)

"""The kernel floor: every Triton and Gluon kernel of the engine, and how each is chosen. It sits below the layers
and the attention backends and imports neither; their torch code (layers/*.py, attention/torch_ref.py) is each
kernel's CPU path and reference.

kernel.py      the one shape: Kernel(name, supports, launch, pays) and Lazy (a launch imported on first use)
registry.py    the entries the layers ask (RMS_NORM.choose(x, weight, eps), ...) and their limits; no triton
fit.py         tiles that fit the device's shared memory: ladders of smaller tiles, first_that_builds
pdl.py         programmatic dependent launch for the small kernels of a decode step
act.py norm.py rotary.py mla_prep.py prefill_kv.py router.py skinny.py   the layers' fused Triton kernels
index_topk.py  sparse attention's index scores and top-k slots
block_fp8.py   linear layers over block-FP8 weights, a path per row count: fp8_decode.py (W8A16), fp8_prefill.py
               (W8A8), fp8_quant.py, fp8_torch.py (torch's blockwise scaled_mm), fp8_dequant.py (dequantize + cuBLAS),
               fp8_flashinfer.py (FlashInfer's sm_90 block-scaled GEMM, a peer, off until measured)
mla_decode/    paged MLA decode: a table of Triton and Gluon split steps (its __init__ maps it)
prefill_attn/  varlen causal prefill attention with V narrower than K (MLA's 192/128), no V padding
moe/           fused MoE: a table of grouped_mm, W8A8 tiles, pair tiles and sorted tiles (its __init__ maps it)

Tuning knobs live in mla_decode/tuning.py, which only benchmarks import.
"""

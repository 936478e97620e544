"""Fused MoE on the GPU: the routed experts of a batch in a few launches, without a host sync.

dispatch.py      the table (grouped_mm, fp8_w8a8_tiles, pair_tiles, sorted_tiles) and fused_experts, the layers' entry
grouped_mm.py    long prompts through torch._grouped_mm
tiled.py         pair tiles and sorted tiles over grouped_gemm.py's Triton GEMM (block-FP8 experts too, W8A16 or
                 W8A8); sort.py sorts pairs by expert
combine.py       each token's pair outputs summed (and weighed), plus an addend; gated.py act(gate) * up
"""

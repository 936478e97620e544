"""Varlen causal prefill attention: K and V of different head widths (MLA's 192 and 128) without padding V.

triton_prefill.py  the Triton kernel: prefill_attention (the engine's call), prefill_attention_tiled (one tile, for
                   benchmarks), tile_map (query tiles -> sequences, on the device)
tiles.py           the default tile, the candidates a benchmark sweeps, the ladder of smaller tiles, the head split
reference.py       the same in plain torch, float32: the kernel's reference on any device

Only tiles.py and reference.py import without triton. Where it runs is attention/sdpa.py's choice (registry.py's
PREFILL_ATTENTION entry and TRITON_PREFILL_BY_DEFAULT).
"""

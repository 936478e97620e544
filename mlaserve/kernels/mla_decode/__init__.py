"""Paged MLA decode: absorbed queries attend over the latent cache, one kernel per call chosen from a table.

decode.py      the engine's entry: mla_decode(q, kv_cache, block_table, seq_lens, max_seq_len, kv_lora_rank, scale,
               q_pe) -> the dispatcher's plan -> its kernel's launch
dispatch.py    the ordered table (DecodeKernel: supports, pays, launch, plan) and the choice, ladder and names
support.py     what a kernel declares it supports (runtime, GPU generation, dtypes, widths)
rules.py       the call's shape, step and device, the measured rules (split counts, when a kernel pays) and plans
tuning.py      named kernels and their knobs, for benchmarks only
triton_split.py  the general Triton split step (any heads, widths, page)
gluon_common.py, gluon_wgmma.py, gluon_wgmma8.py, gluon_fp8.py, gluon_fp8_ring.py  the Hopper split steps
gluon_seesaw.py, gluon_seesaw_ring.py  FlashMLA's seesaw schedule for 64+ heads over 16-bit caches, and its producer
               (off by default: rules.SEESAW_BY_DEFAULT)
spans.py       which rows each program takes (split shares, balanced spans)
partials.py    the split steps' partial outputs and their LSE merge
fp8_query.py   the query as two e4m3 terms (fp8 dots); widen.py  8-bit values widened by integer operations
reference.py   plain torch from block tables: the table's last entry, for any shape on any device

Only decode.py, dispatch.py, support.py, rules.py, tuning.py and reference.py import without triton.
"""

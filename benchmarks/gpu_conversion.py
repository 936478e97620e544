"""The GPU suite's `conversion` section: decode speed of a Llama-3-8B-shaped model (random bf16 weights) served
with its per-head K/V cache against the same model converted to MLA at load time at each of the quality table's KV
cuts (benchmarks/quality.py; what each costs in perplexity is measured there on SmolLM2, not here).

Per layout: batch 32, prompts of 8,000 random ids, 64 new tokens; decode tok/s from the decode-only engine steps
(benchmarks/step_timer.py) and the KV bytes per token. The conversion calibrates on the usual text through a
byte-level tokenizer written beside the config (the weights being random, only the shapes matter here).

    python -m benchmarks.gpu_suite --sections conversion --out benchmarks/results/h200-conversion-DATE.json
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    max_position_embeddings=16384, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
    tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=257, eos_token_id=256,
)  # fmt: skip
# Per layer the original caches 2 x 8 KV heads x 128 = 2,048 values a token; each cut keeps rope features per KV head
# (x 8) plus a latent: -25% 8 x 128 + 512, -50% 8 x 64 + 512, -75% 8 x 32 + 256, -87.5% 8 x 16 + 128.
LAYOUTS = [
    ("original (per-head K/V)", {}),
    ("MLA exact (same bytes)", dict(enable_mla=True)),
    ("MLA -25% (values only)", dict(enable_mla=True, mla_latent_dim=512, qk_rope_head_dim=128)),
    ("MLA -50%", dict(enable_mla=True, mla_latent_dim=512, qk_rope_head_dim=64)),
    ("MLA -75%", dict(enable_mla=True, mla_latent_dim=256, qk_rope_head_dim=32)),
    ("MLA -87.5%", dict(enable_mla=True, mla_latent_dim=128, qk_rope_head_dim=16)),
]
BATCH, CONTEXT, NEW = 32, 8000, 64


def conversion(tmp: Path, timer_cls: type, byte_tokenizer: Callable[[Path], None]) -> dict:
    from mlaserve import LLM, SamplingParams

    folder = tmp / "llama3-8b-shape"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    byte_tokenizer(folder)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 256, (CONTEXT,), generator=gen).tolist()} for _ in range(BATCH)
    ]
    rows = []
    for name, options in LAYOUTS:
        row: dict = {"layout": name, "options": options}
        gc.collect()
        torch.cuda.empty_cache()
        try:
            llm = LLM(str(folder), dtype="bfloat16", device="cuda", load_format="dummy", block_size=64,
                      max_model_len=CONTEXT + NEW + 64, max_num_seqs=BATCH, gpu_memory_utilization=0.85,
                      **options)  # fmt: skip
            row["kv_bytes_per_token"] = llm.stats()["kv_bytes_per_token"]
            row["decode_graphs"] = llm.engine.runner.graphs is not None
            llm.generate(
                prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
            )
            llm.engine.kv_manager.reset_prefix_cache()
            with timer_cls(llm.engine, torch.cuda.synchronize) as timer:
                llm.generate(
                    prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False
                )
            row["decode_tok_s_batch32_8k"] = timer.tokens_per_s
            row["decode_steps_timed"] = timer.steps
            del llm
        except Exception as e:  # noqa: BLE001 - the other layouts' figures still count
            row["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = rows[0].get("decode_tok_s_batch32_8k")
    for row in rows:
        speed = row.get("decode_tok_s_batch32_8k")
        row["speedup_vs_original"] = speed / base if speed and base else None
    return {"rows": rows, "batch": BATCH, "context": CONTEXT, "new_tokens": NEW}

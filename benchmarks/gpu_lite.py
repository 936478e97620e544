"""The DeepSeek-V2-Lite shape end to end (random bf16 weights, load_format="dummy") and the engine sections built
on it: tiny (triton against torch tokens on a tiny model), lite (512 + 64 tokens at batch 1 and 32, transformers as
the peer), mla_vs_mha (latent against per-head caches in the same KV memory) and throughput; with the workload
helpers other sections (mixed, fp8, tp, spec) share."""

import gc
import json
import time
from pathlib import Path

import torch

from benchmarks.step_timer import DecodeStepTimer

KV_BYTES = 60 << 30  # the same KV memory for every mode of the MLA-vs-MHA table

V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048, num_hidden_layers=27,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
    moe_intermediate_size=1408, intermediate_size=10944, first_k_dense_replace=1, vocab_size=102400,
    max_position_embeddings=163840, rms_norm_eps=1e-6, topk_method="greedy", n_group=1, topk_group=1,
    routed_scaling_factor=1.0, norm_topk_prob=False, bos_token_id=100000, eos_token_id=100001,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707,
                  "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}, rope_theta=10000, torch_dtype="bfloat16",
)  # fmt: skip


def random_prompts(gen: torch.Generator, count: int, length: int) -> list[dict]:
    """count prompts of `length` random token ids (V2-Lite's vocabulary), as LLM.generate takes them."""
    return [
        {"prompt_token_ids": torch.randint(0, 100000, (length,), generator=gen).tolist()}
        for _ in range(count)
    ]


def lite_workload(llm, gen: torch.Generator, batch: int) -> tuple[list[dict], object]:
    """The lite section's prompts (512 random ids each) and greedy 64-token params, after one short warm-up call."""
    from mlaserve import SamplingParams

    prompts = random_prompts(gen, batch, 512)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    # The warm-up's prompt is the first timed prompt: without this, the first repeat at batch 1 found 448 of its
    # 512 prompt tokens cached and skipped most of the prefill that transformers is timed with.
    llm.engine.kv_manager.reset_prefix_cache()
    return prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def timed_walls(llm, prompts: list, params, repeats: int) -> tuple[list[float], list]:
    """Wall seconds of `repeats` generate calls (the device synchronized around each) and the last call's outputs.
    The prefix cache is emptied after each call, so every repeat prefills its prompts again."""
    walls, outs = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        llm.engine.kv_manager.reset_prefix_cache()
    return walls, outs


def lite_llm(folder: Path, **options):
    gc.collect()  # a previous engine's cache must be gone before this one sizes its own
    torch.cuda.empty_cache()
    from mlaserve import LLM

    (folder / "config.json").parent.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(V2_LITE))
    return LLM(str(folder), dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True,
               block_size=64, max_model_len=10240, gpu_memory_utilization=0.85, **options)  # fmt: skip


def timed_burst(llm, prompts: list[dict], new_tokens: int = 100) -> float:
    """Wall seconds of one generate call over every prompt at once (greedy, ignore_eos), the prefix cache emptied
    first; every request must get its new_tokens."""
    from mlaserve import SamplingParams

    llm.engine.kv_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return wall


def byte_tokenizer(folder: Path) -> None:
    from mlaserve.testing.tiny_models import save_byte_tokenizer

    save_byte_tokenizer(folder)


def tiny(tmp: Path) -> dict:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from mlaserve import LLM, SamplingParams

    cfg = DeepseekV2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).save_pretrained(tmp / "tiny")
    gen = torch.Generator().manual_seed(1)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 500, (n,), generator=gen).tolist()} for n in (5, 77, 300, 1)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = {}
    for name, backend, eager in (("torch", "torch", True), ("triton_eager", "triton_mla", True),
                                 ("triton_graphs", "triton_mla", False)):  # fmt: skip
        llm = LLM(str(tmp / "tiny"), dtype="bfloat16", device="cuda", attention_backend=backend, enforce_eager=eager,
                  skip_tokenizer_init=True, num_kv_blocks=512, block_size=64, max_model_len=2048)  # fmt: skip
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm

    def compare(a: str, b: str) -> dict:
        pairs = list(zip(outs[a], outs[b]))
        first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in pairs]
        return {"rows_identical": [p == q for p, q in pairs], "first_difference": first}

    return {
        "torch_vs_triton_eager": compare("torch", "triton_eager"),
        "triton_eager_vs_graphs": compare("triton_eager", "triton_graphs"),
        "note": "bf16: kernels sum in different orders, so near-tied logits may flip late tokens",
    }


def lite(tmp: Path, hf_peer: bool, eager: bool = False, profile: bool = False) -> dict:
    from mlaserve import LLM, SamplingParams

    folder = tmp / "v2lite"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(V2_LITE))
    t0 = time.perf_counter()
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True,
              block_size=64, max_model_len=4096, gpu_memory_utilization=0.85, enforce_eager=eager)  # fmt: skip
    result = {"load_s": time.perf_counter() - t0, "stats": llm.stats()}
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 32):
        prompts, params = lite_workload(llm, gen, batch)
        # Repeats once spread 2-3x (cuDNN plans per prefill shape, mid-run compiles): every wall time is kept.
        walls, outs = timed_walls(llm, prompts, params, 5)
        wall = sorted(walls)[len(walls) // 2]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result[f"mlaserve_batch{batch}_tok_s"] = tokens / wall
        result[f"mlaserve_batch{batch}_walls_s"] = walls
        print(
            f"lite batch {batch}: {tokens / wall:.1f} tok/s (median of {[round(w, 2) for w in walls]} s)",
            flush=True,
        )
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        prompts = random_prompts(gen, 1, 512)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
            )
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20), flush=True)
    del llm
    gc.collect()  # the engine's cycles hold its KV cache until collected: transformers' model needs the memory
    torch.cuda.empty_cache()
    if hf_peer:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(folder)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        for batch in (1, 32):
            ids = torch.randint(0, 100000, (batch, 512), device="cuda")
            model.generate(ids[:, :16], max_new_tokens=2, do_sample=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
            )
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            result[f"transformers_batch{batch}_tok_s"] = batch * (out.shape[1] - 512) / wall
            print(f"hf batch {batch}: {result[f'transformers_batch{batch}_tok_s']:.1f} tok/s", flush=True)
    return result


def mla_vs_mha(tmp: Path) -> dict:
    """Decode tok/s at batch 32 and the most sequences that fit, same KV memory: latent bf16 / fp8 / mla_disable."""
    from mlaserve import SamplingParams

    rows = []
    gen = torch.Generator().manual_seed(0)
    for mode, options in (("latent_bf16", {}), ("latent_fp8", {"kv_cache_dtype": "fp8_e4m3"}),
                          ("mla_disable", {"mla_disable": True})):  # fmt: skip
        llm = lite_llm(tmp / "v2lite", kv_cache_memory_bytes=KV_BYTES, **options)
        stats = llm.stats()
        for context in (512, 2048, 8192):
            prompts = random_prompts(gen, 32, context)
            llm.engine.kv_manager.reset_prefix_cache()
            with DecodeStepTimer(llm.engine, torch.cuda.synchronize) as timer:
                llm.generate(
                    prompts, SamplingParams(temperature=0, max_tokens=65, ignore_eos=True), use_tqdm=False
                )
            blocks_per_seq = -(-(context + 64) // stats["block_size"])
            row = dict(mode=mode, context=context, kv_bytes_per_token=stats["kv_bytes_per_token"],
                       kv_blocks_total=stats["kv_blocks_total"],
                       max_concurrent_seqs=stats["kv_blocks_total"] // blocks_per_seq,
                       decode_tok_s_batch32=timer.tokens_per_s, decode_steps_timed=timer.steps)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
        torch.cuda.empty_cache()
    return {"rows": rows, "kv_memory_bytes": KV_BYTES}


def throughput(tmp: Path) -> dict:
    """256 requests of 1,000 random prompt tokens and 100 output tokens (ignore_eos), all submitted at once."""
    from mlaserve import SamplingParams

    llm = lite_llm(tmp / "v2lite", max_num_seqs=256)
    gen = torch.Generator().manual_seed(1)
    prompts = random_prompts(gen, 256, 1000)
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    wall = timed_burst(llm, prompts)
    result = {"requests": 256, "wall_s": wall, "req_per_s": 256 / wall, "output_tok_per_s": 25600 / wall}
    print(json.dumps(result), flush=True)
    return result

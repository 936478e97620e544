"""Where bf16 greedy runs leave the float32 run of the same tiny model and cache, on CPU: the first differing token
of each prompt and the gap between the two tokens under the float32 run's logprobs. The evidence for the GPU tests'
near-tie bounds (tests/gpu/test_greedy_on_gpu.py: TIE_NATS, EIGHT_BIT_TIE_NATS).

    python benchmarks/diagnose/bf16_ties.py

The model and prompts are tests/gpu/test_mla_shapes_on_gpu.py's (DeepSeek-V2, 5 heads, rank 24, rope 8); each
prompt is run in one batch and alone.
"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mlaserve import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import build_tiny  # noqa: E402

SHAPE = dict(num_attention_heads=5, kv_lora_rank=24, qk_rope_head_dim=8, hidden_size=80)


def main() -> None:
    path = build_tiny("deepseek_v2", Path(tempfile.mkdtemp()), **SHAPE)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (1, 7, 40, 120)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=20)

    def run(dtype: str, kv_cache_dtype: str, batched: bool) -> list:
        llm = LLM(str(path), dtype=dtype, device="cpu", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=96,
                  block_size=16, max_model_len=256, max_num_seqs=8)  # fmt: skip
        if batched:
            return llm.generate(prompts, params, use_tqdm=False)
        return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]

    for cache in ("auto", "fp8_e4m3"):
        ref = run("float32", cache, True)
        for label, batched in (("batched", True), ("alone", False)):
            for i, (want, have) in enumerate(zip(ref, run("bfloat16", cache, batched), strict=True)):
                a, b = want.outputs[0].token_ids, have.outputs[0].token_ids
                first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
                if first is None:
                    print(f"cache {cache}, bf16 {label}, prompt {i}: same tokens")
                    continue
                step = want.outputs[0].logprobs[first]
                gap = step[a[first]] - step.get(b[first], float("-inf"))
                print(
                    f"cache {cache}, bf16 {label}, prompt {i}: first differs at token {first}, gap {gap:.3f} nats"
                )


if __name__ == "__main__":
    main()

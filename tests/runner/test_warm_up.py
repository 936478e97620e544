"""ModelRunner.warm_up (run at GPU start-up) writes only to the null block: generation afterwards is unchanged."""

import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny


def test_warm_up_leaves_outputs_and_cache_alone(tmp_path):
    path = build_tiny("deepseek_v2", tmp_path)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, block_size=16, max_model_len=128)
    prompts = [{"prompt_token_ids": [5 + i for i in range(n)]} for n in (3, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.kv_manager.reset_prefix_cache()
    caches = [c.clone() for c in llm.engine.executor.kv_caches]
    llm.engine.runner.warm_up(300, 128)  # three dummy prompts: 128 + 128 + 44 tokens
    for before, after in zip(caches, llm.engine.executor.kv_caches):
        assert torch.equal(before[1:], after[1:])  # every block but the null block (0) is untouched
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.stats()["kv_blocks_used"] == 0

"""On a GPU: float32 DeepSeek-V2, V3 and V3.2 engines at widths that are no multiple of the kernels' tiles (7 heads,
a 40-wide latent, 16-wide rope, hidden 224, expert width 80) with CUDA graphs on, captured up to the default
max_num_seqs (so the MoE's 64- and 128-row tiles are built), against the torch backend run eagerly. The kernels
alone at these widths are the twin test tests/kernels/test_odd_widths.py."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, LAT, ROPE, HIDDEN, INTER = 7, 40, 16, 224, 80


ODD = dict(
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    kv_lora_rank=LAT,
    qk_rope_head_dim=ROPE,
    qk_nope_head_dim=24,
    v_head_dim=20,
    intermediate_size=180,
    moe_intermediate_size=INTER,
)


def greedy_runs(path) -> dict[str, list]:
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (1, 9, 77, 300)
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    runs = {}
    for label, backend, eager in (("ref", "torch", True), ("graphs", "triton_mla", False)):
        llm = LLM(str(path), dtype="float32", device="cuda", attention_backend=backend, enforce_eager=eager,
                  num_kv_blocks=1024, block_size=16, max_model_len=512)  # fmt: skip
        if not eager:  # captured up to the default max_num_seqs: 256 rows, 64-row MoE tiles
            assert llm.engine.runner.graphs is not None and max(llm.engine.runner.graphs.sizes) == 256
        runs[label] = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats()["kv_blocks_used"] == 0
        del llm
    return runs


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "deepseek_v32"])
def test_float32_engine_at_odd_widths_equals_the_torch_backend(tmp_path, name):
    runs = greedy_runs(build_tiny(name, tmp_path, **ODD))
    for ref, got in zip(runs["ref"], runs["graphs"]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        for want, have, tok in zip(
            ref.outputs[0].logprobs, got.outputs[0].logprobs, ref.outputs[0].token_ids
        ):
            assert abs(want[tok].logprob - have[tok].logprob) < 1e-3

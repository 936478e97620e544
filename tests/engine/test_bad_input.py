"""Bad input is a clear error that names the problem and starts no work."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny("deepseek_v2", tmp_path_factory.mktemp("ds2"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=64)


def copy_model(src, dst):
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))


def test_unsupported_architecture(model_dir, tmp_path):
    bad = copy_model(model_dir, tmp_path)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["DeepseekV2ForSequenceClassification"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'DeepseekV2ForSequenceClassification'"):
        LLM(str(bad), device="cpu")


def test_wrongly_shaped_and_missing_tensors(model_dir, tmp_path):
    bad = copy_model(model_dir, tmp_path)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    tensors[name] = torch.zeros(3, 3)
    del tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.surprise.weight"] = torch.zeros(2)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        LLM(str(bad), device="cpu", num_kv_blocks=16)
    message = str(err.value)
    assert name in message and "(3, 3)" in message
    assert "model.norm.weight" in message
    assert "surprise" in message


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_engine_option(model_dir):
    with pytest.raises(TypeError, match="gpu_memory_utilisation"):
        LLM(str(model_dir), gpu_memory_utilisation=0.5)


def test_bad_engine_option_values(model_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(model_dir), block_size=24)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(model_dir), device="cpu", max_model_len=10**7)
    with pytest.raises(ValueError, match="one request of max_model_len=256 tokens needs 16"):
        LLM(str(model_dir), device="cpu", num_kv_blocks=2, max_model_len=256)


def test_prompt_longer_than_max_model_len_starts_no_work(llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    too_long = {"prompt_token_ids": [5] * 80}
    with pytest.raises(ValueError, match=r"prompt 1: .*80 tokens.*max_model_len=64"):
        llm.generate([good, too_long], SamplingParams(max_tokens=4), use_tqdm=False)
    stats = llm.stats()
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    # The engine still serves after the rejection.
    out = llm.generate([good], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([{"prompt_token_ids": [1, 10**6]}], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([42], use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        llm.generate(["w3", "w4"], [SamplingParams()], use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_window_that_cannot_be_served_is_an_error_before_weights_load(tmp_path, monkeypatch):
    import json

    path = build_tiny("mistral", tmp_path, sliding_window=32)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": -8}))
    loaded = []
    monkeypatch.setattr("mlaserve.executor.model_build.build_model", lambda *a, **k: loaded.append(1))
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        LLM(str(path), device="cpu", num_kv_blocks=16)
    assert not loaded


def test_duplicate_request_id_is_rejected_and_the_first_request_is_untouched(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, params, request_id="same")
    with pytest.raises(ValueError, match="same"):
        engine.add_request({"prompt_token_ids": [8, 9]}, params, request_id="same")
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["same"] and done[0].prompt_token_ids == [5, 6, 7]
    assert len(done[0].outputs[0].token_ids) == 3 and llm.stats()["kv_blocks_used"] == 0

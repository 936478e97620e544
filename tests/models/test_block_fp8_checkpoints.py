"""DeepSeek's block-FP8 checkpoints served on the CPU path: a tiny DeepSeek-V3 whose widths are no multiples of the
128-wide blocks (hidden 224, q_lora 96, kv_lora 40, experts 80 wide, two shared experts), written in DeepSeek's
sharded layout, against transformers running the same model on the dequantized weights; the online quantization
of its float checkpoint; and the errors a broken checkpoint gets.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.testing.fp8_checkpoint import save_block_fp8, save_dequantized
from mlaserve.testing.tiny_models import build_tiny, load_reference

ODD = dict(
    hidden_size=224,
    q_lora_rank=96,
    kv_lora_rank=40,
    qk_rope_head_dim=16,
    qk_nope_head_dim=24,
    v_head_dim=20,
    intermediate_size=200,
    moe_intermediate_size=80,
    n_shared_experts=2,
)
NEW_TOKENS = 12
OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=256)


def prompts(seed: int = 1, lengths=(3, 17, 40, 1, 25)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("fp8")
    src = build_tiny("deepseek_v3", tmp / "src", **ODD)
    fp8 = save_block_fp8(src, tmp / "fp8")
    # One shared expert: online quantization cuts the shared MLP into its experts before quantizing, so only then
    # do its blocks coincide with those of the checkpoint's whole shared tensor.
    src_one = build_tiny("deepseek_v3", tmp / "src_one", **{**ODD, "n_shared_experts": 1})
    online = save_block_fp8(src_one, tmp / "online_bytes", other_dtype=None)
    return {
        "fp8": fp8,
        "ref": save_dequantized(fp8, tmp / "ref"),
        "src_one": src_one,
        "online_fp8": online,
        "online_ref": save_dequantized(online, tmp / "online_ref"),
    }


def reference_run(folder: Path, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the log-softmax of every step (teacher forcing)."""
    hf = load_reference(folder)
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = out[0, len(prompt) :].tolist()
    with torch.no_grad():
        logits = hf(out).logits[0, len(prompt) - 1 : -1].float()
    return tokens, logits.log_softmax(-1)


def assert_matches_reference(outs, batch: list[list[int]], folder: Path) -> None:
    """Greedy tokens equal transformers' up to a near-tie (its top two within 0.05 nats), logprobs within 0.05."""
    for prompt, out in zip(batch, outs, strict=True):
        tokens, logprobs = reference_run(folder, prompt)
        ours = out.outputs[0].token_ids
        for step, (want, got) in enumerate(zip(tokens, ours, strict=True)):
            top2 = logprobs[step].topk(2).values
            if want != got:
                assert top2[0] - top2[1] < 0.05, f"prompt of {len(prompt)}: step {step} is no near-tie"
                break
            assert abs(out.outputs[0].logprobs[step][got].logprob - logprobs[step, got].item()) < 0.05


def test_deepseek_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(checkpoints):
    files = json.loads((checkpoints["fp8"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(files.values())) == 3 and any(name.endswith("weight_scale_inv") for name in files)
    llm = LLM(str(checkpoints["fp8"]), **OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    batch = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert_matches_reference(outs, batch, checkpoints["ref"])
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    experts = llm.engine.core.executor.model.model.layers[1].mlp.experts
    assert (
        experts.w13.dtype == torch.float8_e4m3fn and experts.group_n == 1
    )  # 80-wide experts: per-row scales


def test_online_fp8_quantizes_a_float_checkpoint_into_the_same_format(checkpoints):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    batch = [{"prompt_token_ids": p} for p in prompts(seed=4)]
    online = LLM(str(checkpoints["src_one"]), quantization="fp8", **OPTIONS).generate(
        batch, params, use_tqdm=False
    )
    assert_matches_reference(online, [p["prompt_token_ids"] for p in batch], checkpoints["online_ref"])
    stored = LLM(str(checkpoints["online_fp8"]), **OPTIONS).generate(batch, params, use_tqdm=False)
    for a, b in zip(online, stored, strict=True):  # the same weights as the checkpoint quantized offline
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for token, x, y in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x[token].logprob - y[token].logprob) < 1e-5


def test_batched_chunked_and_prefix_hits_give_the_same_tokens(checkpoints):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    shared = prompts(seed=3, lengths=(40,))[0]
    batch = [{"prompt_token_ids": shared + p} for p in prompts(seed=2)]

    def tokens(**options) -> list[list[int]]:
        llm = LLM(str(checkpoints["fp8"]), **{**OPTIONS, "block_size": 4, **options})
        return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]

    plain = tokens(enable_prefix_caching=False)
    one = LLM(str(checkpoints["fp8"]), **OPTIONS, enable_prefix_caching=False)
    assert [one.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in batch] == plain
    assert tokens(max_num_batched_tokens=16) == plain
    cached = LLM(str(checkpoints["fp8"]), **{**OPTIONS, "block_size": 4})
    cached.generate(batch[:1], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cached.generate(batch, params, use_tqdm=False)] == plain
    assert cached.stats()["prefix_cache_hits"] > 0


def broken_copy(source: Path, folder: Path, edit) -> Path:
    """A copy of the FP8 checkpoint whose shards pass through edit(name -> tensor dict)."""
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(str(path))
            edit(tensors)
            save_file(tensors, str(folder / path.name), metadata={"format": "pt"})
        else:
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


SCALE = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
DENSE_SCALE = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop(SCALE, None), "missing (1): model.layers.1.mlp.experts.w2_scale shards [3]"),
        (
            lambda t: t.pop(DENSE_SCALE, None),
            "missing (1): model.layers.0.self_attn.kv_b_proj.weight_scale_inv",
        ),
        (
            lambda t: t.update({DENSE_SCALE: torch.ones(3, 1)}) if DENSE_SCALE in t else None,
            f"{DENSE_SCALE} (weight_scale_inv: checkpoint shape (3, 1), expected (2, 1)",
        ),
    ],
    ids=["expert-scale-missing", "dense-scale-missing", "scale-misshapen"],
)
def test_a_broken_checkpoint_names_the_tensor_before_serving(checkpoints, tmp_path, edit, message):
    folder = broken_copy(checkpoints["fp8"], tmp_path / "broken", edit)
    with pytest.raises(ValueError) as info:
        LLM(str(folder), **OPTIONS)
    assert message in str(info.value)


def test_weights_are_counted_by_kind_and_checked_against_free_memory(checkpoints, monkeypatch):
    from mlaserve.config.quantization import BlockFP8Config
    from mlaserve.executor.load_model import check_weights_fit
    from mlaserve.models.base import ModelInit
    from mlaserve.models.deepseek import DeepseekV3ForCausalLM
    from mlaserve.testing.tiny_models import config_dict

    llm = LLM(str(checkpoints["fp8"]), **{**OPTIONS, "dtype": "bfloat16"})
    stats = llm.stats()
    kinds = stats["weight_bytes_by_kind"]
    model = llm.engine.core.executor.model
    fp8 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    assert kinds["float8_e4m3fn"] == fp8 > kinds["bfloat16"] / 2
    assert kinds["fp8 scales"] % 4 == 0 and stats["weight_bytes"] == sum(kinds.values())
    assert stats["quantization"] == "fp8"

    # the check before any allocation: the model built on the meta device, its FP8 bytes against free memory
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**config_dict(checkpoints["fp8"]))
    init = ModelInit(cfg, None, quant=BlockFP8Config(from_checkpoint=True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 20, 80 << 30))
    with pytest.raises(
        ValueError, match=r"weights \(fp8 weights\) need 0\.0 GiB on this rank, and the GPU has 0\.0"
    ):
        check_weights_fit(DeepseekV3ForCausalLM, init, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 30, 80 << 30))
    check_weights_fit(DeepseekV3ForCausalLM, init, torch.device("cuda"))


def with_mtp_layer(source: Path, folder: Path) -> Path:
    """The float checkpoint with one multi-token-prediction layer after its last, named as DeepSeek-V3 ships it
    (model.layers.N.*: enorm, hnorm, eh_proj, a decoder layer, shared_head, and copies of embed_tokens)."""
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    last, hidden = config["num_hidden_layers"] - 1, config["hidden_size"]
    gen = torch.Generator().manual_seed(7)
    for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
        tensors[name.replace(f".{last}.", f".{last + 1}.", 1)] = tensors[name] + 0.01
    mtp = f"model.layers.{last + 1}."
    tensors |= {
        mtp + "enorm.weight": torch.rand(hidden, generator=gen),
        mtp + "hnorm.weight": torch.rand(hidden, generator=gen),
        mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
        mtp + "shared_head.norm.weight": torch.rand(hidden, generator=gen),
        mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return folder


def test_the_multi_token_prediction_layer_loads_from_the_fp8_checkpoint(checkpoints, tmp_path):
    from transformers import AutoConfig

    from mlaserve.config.quantization import BlockFP8Config
    from mlaserve.layers.block_fp8 import dequantize
    from mlaserve.loader.safetensors_reader import iter_safetensor_slices
    from mlaserve.loader.weights import load_weights
    from mlaserve.models.base import ModelInit
    from mlaserve.models.deepseek import DeepseekV3ForCausalLM
    from mlaserve.testing.tiny_models import config_dict

    src = with_mtp_layer(checkpoints["src_one"], tmp_path / "src")
    fp8 = save_block_fp8(src, tmp_path / "fp8", other_dtype=None)
    cfg = AutoConfig.for_model(**config_dict(fp8))
    quant = BlockFP8Config(from_checkpoint=True)
    model = DeepseekV3ForCausalLM(ModelInit(cfg, None, quant=quant, mtp_layers=1))
    report = load_weights(model, iter_safetensor_slices(fp8))
    assert report.ok, report.summary()
    assert report.ignored == 2  # the MTP layer's copies of the embedding and the LM head
    source = load_file(str(src / "model.safetensors"))
    mtp, layer = model.mtp[0], cfg.num_hidden_layers
    torch.testing.assert_close(mtp.eh_proj.weight, source[f"model.layers.{layer}.eh_proj.weight"])
    experts = mtp.block.mlp.experts
    got = dequantize(experts.w2[3], experts.w2_scale[3], experts.group_n)
    want = source[f"model.layers.{layer}.mlp.experts.3.down_proj.weight"]
    torch.testing.assert_close(got, want, atol=0.07 * want.abs().max().item(), rtol=0)

    # without MTP modules the same checkpoint serves, its MTP tensors left unread
    plain = DeepseekV3ForCausalLM(ModelInit(cfg, None, quant=quant))
    report = load_weights(plain, iter_safetensor_slices(fp8))
    assert report.ok and report.ignored > 20


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v32"])
def test_other_deepseek_fp8_checkpoints_match_transformers(tmp_path, name):
    """V2 (no q_lora: q_proj fused with kv_a) and V3.2 (the indexer's wq_b and wk in FP8 too)."""
    widths = {**ODD, "q_lora_rank": None} if name == "deepseek_v2" else ODD
    fp8 = save_block_fp8(build_tiny(name, tmp_path / "src", **widths), tmp_path / "fp8")
    if name == "deepseek_v32":
        names = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
        assert any(n.endswith("indexer.wk.weight_scale_inv") for n in names)
    ref = save_dequantized(fp8, tmp_path / "ref")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    batch = prompts(seed=5, lengths=(30, 4))
    outs = LLM(str(fp8), **OPTIONS).generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert_matches_reference(outs, batch, ref)

"""DeepSeek-V4 in the layout DeepSeek publishes V4-Flash (block-FP8 projections with e8m0 `.scale` tensors, MXFP4
routed experts, DeepSeek's own tensor names, sharded) served on the CPU path, against transformers running the same
tiny model on the dequantized weights; the weight accounting; and the errors a broken checkpoint gets."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny
from mlaserve.testing.v4_checkpoint import save_dequantized_v4, save_v4_published
from tests.models.test_block_fp8_checkpoints import assert_matches_reference, prompts

OPTIONS = dict(dtype="float32", device="cpu", num_kv_blocks=256)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("v4_mxfp4")
    src = build_tiny("deepseek_v4", tmp / "src")
    published = save_v4_published(src, tmp / "published")
    return {"src": src, "published": published, "ref": save_dequantized_v4(published, src, tmp / "ref")}


def test_published_layout_matches_transformers_on_its_dequantized_weights(checkpoints):
    llm = LLM(str(checkpoints["published"]), **OPTIONS)
    batch = prompts(seed=4, lengths=(11, 40, 3, 27))  # past the window of 16 and the 8:1 and 4:1 entries
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert_matches_reference(outs, batch, checkpoints["ref"])
    assert llm.stats()["quantization"] == "fp8"


def test_weight_accounting_counts_the_packed_experts(checkpoints):
    stats = LLM(str(checkpoints["published"]), **OPTIONS).stats()
    kinds = stats["weight_bytes_by_kind"]
    cfg = json.loads((checkpoints["src"] / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    per_expert = 3 * hidden * inter  # w1, w3 and w2, each hidden x inter values
    experts = cfg["num_hidden_layers"] * cfg["n_routed_experts"]
    assert kinds["mxfp4"] == experts * per_expert // 2  # half a byte per value
    assert kinds["mxfp4 scales"] == experts * per_expert // 32  # a byte per 32 values
    assert kinds["float8_e4m3fn"] > 0 and "fp8 scales" in kinds
    assert stats["weight_bytes"] == sum(kinds.values())


def test_every_projection_takes_the_format_it_ships_in(checkpoints):
    """FP8 where DeepSeek stores FP8; the compressors, the indexer's weights_proj and the router unquantized."""
    from mlaserve.layers.mxfp4_experts import MXFP4Experts

    model = LLM(str(checkpoints["published"]), **OPTIONS).engine.runner.model
    fp8 = torch.float8_e4m3fn
    for layer in model.model.layers:
        attn, ffn = layer.attn, layer.ffn
        for proj in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a, attn.wo_b, *ffn.shared_experts.children()):
            assert proj.weight.dtype == fp8
        assert isinstance(ffn.experts, MXFP4Experts)
        assert ffn.gate.weight.dtype == torch.float32
        if attn.compressor is not None:
            assert attn.compressor.wkv.weight.dtype == attn.compressor.wgate.weight.dtype == torch.float32
        if attn.indexer is not None:
            assert attn.indexer.wq_b.weight.dtype == fp8
            assert attn.indexer.weights_proj.weight.dtype == torch.float32


def _broken(checkpoints, tmp_path: Path, edit) -> Path:
    """A copy of the published checkpoint, one shard's tensors changed by edit(tensors)."""
    folder = tmp_path / "broken"
    shutil.copytree(checkpoints["published"], folder)
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(shard))
        if edit(tensors):
            save_file(tensors, str(shard), metadata={"format": "pt"})
            index = json.loads((folder / "model.safetensors.index.json").read_text())
            index["weight_map"] = {
                n: s for n, s in index["weight_map"].items() if n in tensors or s != shard.name
            } | dict.fromkeys(tensors, shard.name)
            (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _edit(name: str, change):
    def edit(tensors: dict) -> bool:
        if name not in tensors:
            return False
        change(tensors, name)
        return True

    return edit


@pytest.mark.parametrize(
    "name, change, message",
    [
        (
            "layers.1.ffn.experts.3.w1.scale",
            lambda t, n: t.pop(n),
            r"missing \(1\): model.layers.1.ffn.experts.w13_scale shards \[\(3, 0\)\]",
        ),
        (
            "layers.1.ffn.experts.3.w2.weight",  # unpacked: one value per byte
            lambda t, n: t.__setitem__(n, torch.zeros(64, 32, dtype=torch.int8)),
            r"layers.1.ffn.experts.3.w2.weight \(packed FP4 weight \(two values per byte\): checkpoint shape "
            r"\(64, 32\), expected \(64, 16\)\)",
        ),
        (
            "layers.1.ffn.experts.3.w3.weight",  # FP8 where MXFP4 belongs
            lambda t, n: t.__setitem__(n, t[n].view(torch.float8_e4m3fn)),
            r"layers.1.ffn.experts.3.w3.weight \(packed FP4 weight.*checkpoint dtype torch.float8_e4m3fn",
        ),
        (
            "layers.0.attn.wq_a.scale",
            lambda t, n: t.pop(n),
            r"missing \(1\): model.layers.0.attn.wq_a.weight_scale_inv",
        ),
        (
            "layers.1.ffn.experts.3.w1.weight",  # a ninth expert where config.json says eight
            lambda t, n: t.__setitem__(n.replace(".3.", ".8."), t[n].clone()),
            r"layers.1.ffn.experts.8.w1.weight \(expert 8: the model has 8 routed experts\)",
        ),
    ],
    ids=[
        "missing-expert-scale",
        "unpacked-expert",
        "fp8-expert",
        "missing-linear-scale",
        "expert-past-the-end",
    ],
)
def test_broken_checkpoints_name_the_tensor(checkpoints, tmp_path, name, change, message):
    folder = _broken(checkpoints, tmp_path, _edit(name, change))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), **OPTIONS)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.__setitem__("expert_dtype", "int4"), r"model config expert_dtype='int4' is not served"),
        (
            lambda c: c["quantization_config"].__setitem__("expert_dtype", "nvfp4"),
            r"quantization_config.expert_dtype='nvfp4' is not served",
        ),
        (lambda c: c.pop("quantization_config"), r"expert_dtype='fp4' without a quantization_config"),
    ],
    ids=["top-level", "in-section", "no-section"],
)
def test_bad_expert_dtype_is_refused_by_key(checkpoints, tmp_path, edit, message):
    folder = tmp_path / "config"
    shutil.copytree(checkpoints["published"], folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), **OPTIONS)


def test_fp4_experts_are_refused_where_the_model_has_none(tmp_path):
    from mlaserve.testing.fp8_checkpoint import save_block_fp8

    src = build_tiny("deepseek_v3", tmp_path / "src")
    fp8 = save_block_fp8(src, tmp_path / "fp8")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["expert_dtype"] = "fp4"
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not take MXFP4 experts"):
        LLM(str(fp8), **OPTIONS)


def test_online_fp8_matches_transformers_on_the_weights_it_made(checkpoints, tmp_path):
    """quantization="fp8" on V4's float checkpoint: every projection DeepSeek ships in FP8, and the experts (FP8, as
    a block-FP8 checkpoint without expert_dtype has them), quantized on load; transformers runs what they hold."""
    src = checkpoints["src"]
    llm = LLM(str(src), quantization="fp8", **OPTIONS)
    model = llm.engine.runner.model
    made = {
        name + ".weight": module.dequantized_weight(torch.float32)
        for name, module in model.named_modules()
        if getattr(module, "quant", None) is not None
    }
    assert any(".experts.0.w1." in name for name in made) and any(".attn.wo_a." in name for name in made)
    ref = tmp_path / "online_ref"
    shutil.copytree(src, ref)
    tensors = load_file(str(ref / "model.safetensors"))
    assert set(made) <= set(tensors)
    save_file({**tensors, **made}, str(ref / "model.safetensors"), metadata={"format": "pt"})
    batch = prompts(seed=5, lengths=(9, 33))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    assert_matches_reference(
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False), batch, ref
    )


def test_dummy_weights_fill_the_packed_experts(checkpoints):
    llm = LLM(str(checkpoints["published"]), load_format="dummy", **OPTIONS)
    experts = llm.engine.runner.model.model.layers[1].ffn.experts
    assert experts.w13.float().std() > 0 and (experts.w13_scale == 127 - 8).all()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0]
    assert all(torch.isfinite(torch.tensor(lp[t].logprob)) for lp, t in zip(out.logprobs, out.token_ids))


def test_the_gpu_memory_check_sizes_the_packed_experts(checkpoints):
    """check_weights_fit builds the model on the meta device: there it must take the bytes the loaded model has."""
    from transformers import AutoConfig

    from mlaserve.config.quantization import quant_config
    from mlaserve.models.base import ModelInit
    from mlaserve.models.deepseek_v4 import DeepseekV4ForCausalLM

    folder = checkpoints["published"]
    config = json.loads((folder / "config.json").read_text())
    init = ModelInit(AutoConfig.from_pretrained(str(folder)), None, quant=quant_config(config))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("meta"):
            meta = DeepseekV4ForCausalLM(init)
    finally:
        torch.set_default_dtype(previous)
    need = sum(p.numel() * p.element_size() for p in meta.parameters())
    assert need == LLM(str(folder), **OPTIONS).stats()["weight_bytes"]

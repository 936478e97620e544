"""On a GPU (skipped in CI): Llama-family models served as MLA (enable_mla, exact and at reduced rank) decode through
the Triton MLA kernels from CUDA graphs and give the torch backend's tokens in float32."""

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.testing.tiny_models import build_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def generate(path, backend: str, eager: bool, **options) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (5, 40, 120)
    ]
    llm = LLM(str(path), dtype="float32", device="cuda", attention_backend=backend, enforce_eager=eager,
              num_kv_blocks=128, block_size=16, max_model_len=512, enable_mla=True, **options)  # fmt: skip
    if not eager and not options.get("mla_skip_layers"):
        assert llm.engine.runner.graphs is not None  # the latent cache makes GQA decode capturable
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    assert llm.stats()["kv_blocks_used"] == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "ranks",
    [
        {},
        dict(mla_latent_dim=12, qk_rope_head_dim=8),
        dict(mla_latent_dim=[12, 20], qk_rope_head_dim=8),  # a rank per layer
        dict(
            mla_latent_dim=12, qk_rope_head_dim=8, mla_skip_layers=[1]
        ),  # two kinds of cache rows, eager decode
        dict(mla_latent_dim=24, qk_rope_head_dim=8, mla_rank_allocation="error"),
    ],
    ids=["exact", "reduced", "per-layer", "skip-layer", "ranks-by-error"],
)
@pytest.mark.parametrize(
    "name", ["llama", "mistral"]
)  # (the tiny Qwen2's tokenizer encodes no calibration text)
def test_latent_gqa_triton_graphs_equal_torch_backend(tmp_path, name, ranks):
    path = build_tiny(name, tmp_path, max_position_embeddings=1024)
    assert generate(path, "triton_mla", False, **ranks) == generate(path, "torch", True, **ranks)


def test_a_converted_folder_decodes_on_the_triton_kernels(tmp_path):
    from mlaserve.convert import convert_folder

    src = build_tiny("llama", tmp_path / "src", max_position_embeddings=1024)
    dst = tmp_path / "dst"
    convert_folder(str(src), str(dst), mla_latent_dim=[10, 16], qk_rope_head_dim=8, device="cpu")
    # enable_mla=True is what the folder's own config says; no ranks are given, none are calibrated again
    assert generate(dst, "triton_mla", False) == generate(dst, "torch", True)

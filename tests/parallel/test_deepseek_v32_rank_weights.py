"""What each tensor-parallel rank of DeepSeek-V3.2 loads from DeepSeek's block-FP8 layout: the whole indexer (its FP8
wq_b and wk with every weight_scale_inv block, weights_proj, k_norm), byte for byte one process's, beside its half
of the attention heads. Ranks are built without a process group: loading runs no collective."""

from pathlib import Path

import pytest
import torch

from mlaserve.attention.torch_ref import TorchBackend
from mlaserve.config.model_config import ModelConfig
from mlaserve.executor.load_model import ModelBuild, build_model
from mlaserve.loader.model_files import resolve_model
from mlaserve.parallel import SINGLE, ParallelContext
from mlaserve.testing.fp8_checkpoint import save_block_fp8
from mlaserve.testing.tiny_models import build_tiny

# wq_b's input (q_lora_rank 96) and wk's (hidden 224) end in partial scale blocks; o_proj's 4 x 64 columns split
# into whole blocks of 128 over two ranks
WIDTHS = dict(hidden_size=224, q_lora_rank=96, kv_lora_rank=40, v_head_dim=64, intermediate_size=256,
              moe_intermediate_size=256, index_n_heads=8, index_head_dim=160)  # fmt: skip


@pytest.fixture(scope="module")
def fp8_v32(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("v32_rank_weights")
    return save_block_fp8(build_tiny("deepseek_v32", tmp / "src", **WIDTHS), tmp / "fp8")


def build(folder: Path, ctx: ParallelContext) -> torch.nn.Module:
    files = resolve_model(folder)
    config = ModelConfig.from_hf(files.config_dict, "float32", torch.device("cpu"), 128)
    model, _ = build_model(ModelBuild(config, files, TorchBackend(), torch.device("cpu"), parallel=ctx))
    return model


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def test_every_rank_holds_the_whole_indexer(fp8_v32):
    alone = build(fp8_v32, SINGLE)
    ranks = [build(fp8_v32, ParallelContext(rank, 2)) for rank in (0, 1)]
    for i, layer in enumerate(alone.model.layers):
        want = dict(layer.self_attn.indexer.named_parameters())
        assert want["wq_b.weight"].dtype == torch.float8_e4m3fn and "wk.weight_scale_inv" in want
        # 8 x 160 rows of wq_b: 10 scale blocks by 1 (96 inputs), all of them on every rank
        assert want["wq_b.weight_scale_inv"].shape[0] == 8 * 160 // 128
        for rank, model in enumerate(ranks):
            attn = model.model.layers[i].self_attn
            got = dict(attn.indexer.named_parameters())
            assert got.keys() == want.keys()
            for name, param in want.items():
                assert torch.equal(as_bytes(got[name]), as_bytes(param)), f"rank {rank} layer {i} {name}"
            heads = layer.self_attn.q_b_proj.weight.shape[0] // 2
            rows = layer.self_attn.q_b_proj.weight[rank * heads : (rank + 1) * heads]
            assert torch.equal(as_bytes(attn.q_b_proj.weight), as_bytes(rows))

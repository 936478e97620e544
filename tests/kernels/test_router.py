"""The one-launch Triton scores + top-k against MoEGate's torch routing, under TRITON_INTERPRET=1."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from mlaserve.kernels.router import gate_logits, route_greedy  # noqa: E402
from mlaserve.layers.moe import MoEGate  # noqa: E402


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, sigmoid, normalize, scaling",
    [
        (1, 64, 6, 48, False, False, 1.0),  # DeepSeek-V2-Lite's routing
        (5, 16, 2, 200, False, True, 2.5),  # hidden not a multiple of the H block
        (3, 40, 8, 32, True, True, 2.5),  # V3-style sigmoid + correction bias, one group; experts not 2^n
        (2, 8, 1, 16, True, False, 1.0),
    ],
)
def test_matches_torch_routing(tokens, experts, top_k, hidden, sigmoid, normalize, scaling):
    cfg = SimpleNamespace(
        n_routed_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden, n_group=1, topk_group=1,
        topk_method="noaux_tc" if sigmoid else "greedy", norm_topk_prob=normalize, routed_scaling_factor=scaling,
    )  # fmt: skip
    gate = MoEGate(cfg, sigmoid)
    gen = torch.Generator().manual_seed(tokens * experts)
    gate.weight.data = torch.randn(experts, hidden, generator=gen)
    if sigmoid:
        gate.e_score_correction_bias.data = torch.randn(experts, generator=gen) * 0.1
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    want_w, want_i = gate(x)  # CPU tensors: the torch path
    bias = gate.e_score_correction_bias if sigmoid else None
    got_w, got_i = route_greedy(
        torch.nn.functional.linear(x.float(), gate.weight), bias, top_k, normalize, scaling
    )
    order_want, order_got = want_i.argsort(dim=1), got_i.argsort(dim=1)
    assert torch.equal(want_i.gather(1, order_want), got_i.gather(1, order_got))
    torch.testing.assert_close(got_w.gather(1, order_got), want_w.gather(1, order_want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens, experts, hidden, dtype", [(1, 64, 96, torch.bfloat16), (5, 10, 300, torch.float16),
                                                            (16, 7, 40, torch.float32)])  # fmt: skip
def test_gate_logits_match_float32_linear(tokens, experts, hidden, dtype):
    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden + 2, generator=gen)[:, 1 : 1 + hidden].to(dtype)  # a strided row slice
    w = torch.randn(experts, hidden, generator=gen) / hidden**0.5
    torch.testing.assert_close(
        gate_logits(x, w), torch.nn.functional.linear(x.float(), w), atol=1e-5, rtol=1e-5
    )


def test_gate_logits_rejects_large_batches():
    with pytest.raises(ValueError, match="gate_logits"):
        gate_logits(torch.zeros(17, 8), torch.zeros(4, 8))


@pytest.mark.parametrize("num_shared, sigmoid", [(1, False), (2, True), (3, False)])
def test_shared_experts_follow_the_routed_ones(num_shared, sigmoid):
    experts, top_k, hidden, tokens = 16, 4, 32, 5
    cfg = SimpleNamespace(
        n_routed_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden, n_group=1, topk_group=1,
        topk_method="noaux_tc" if sigmoid else "greedy", norm_topk_prob=True, routed_scaling_factor=2.0,
    )  # fmt: skip
    gate = MoEGate(cfg, sigmoid, num_shared=num_shared)
    gen = torch.Generator().manual_seed(num_shared)
    gate.weight.data = torch.randn(experts, hidden, generator=gen)
    if sigmoid:
        gate.e_score_correction_bias.data = torch.randn(experts, generator=gen) * 0.1
    x = torch.randn(tokens, hidden, generator=gen)
    want_w, want_i = gate(x)  # the torch path, then with_shared_experts
    assert want_i.shape == (tokens, top_k + num_shared)
    assert torch.equal(want_i[:, top_k:], torch.arange(experts, experts + num_shared).expand(tokens, -1))
    assert torch.equal(want_w[:, top_k:], torch.ones(tokens, num_shared))
    bias = gate.e_score_correction_bias if sigmoid else None
    logits = torch.nn.functional.linear(x, gate.weight)
    got_w, got_i = route_greedy(logits, bias, top_k, True, 2.0, num_shared)
    assert torch.equal(got_i[:, top_k:], want_i[:, top_k:])
    assert torch.equal(got_w[:, top_k:], want_w[:, top_k:])
    order_want, order_got = want_i[:, :top_k].argsort(dim=1), got_i[:, :top_k].argsort(dim=1)
    assert torch.equal(want_i.gather(1, order_want), got_i.gather(1, order_got))
    torch.testing.assert_close(got_w.gather(1, order_got), want_w.gather(1, order_want), atol=1e-5, rtol=1e-5)

"""Loading checkpoint tensors into a model: every parameter slice accounted for, or an error that lists them."""

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from mlaserve.loader.checkpoint_slice import ShapeMismatch, default_weight_loader, read


@dataclass
class LoadReport:
    num_tensors: int = 0  # checkpoint tensors loaded into parameters
    num_parameters: int = 0  # model parameters (elements) filled
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatches: list[str] = field(default_factory=list)
    ignored: int = 0  # tensors we know and do not need (rotary caches, MTP layers, tied lm_head)
    # the loaded model's bytes on this rank by kind ("float8_e4m3fn", "fp8 scales", "bfloat16", ...)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shape_mismatches)

    def summary(self) -> str:
        return (
            f"loaded {self.num_tensors} tensors ({self.num_parameters / 1e6:.1f}M parameters), "
            f"{self.ignored} ignored, missing {len(self.missing)}, unexpected {len(self.unexpected)}, "
            f"shape mismatches {len(self.shape_mismatches)}"
        )

    def raise_if_bad(self, source: str) -> None:
        if self.ok:
            return
        lines = [f"weights in {source} do not match the model:"]
        for title, items in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("wrong shape", self.shape_mismatches),
        ):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                lines.append(f"  {title} ({len(items)}): " + ", ".join(shown))
        raise ValueError("\n".join(lines))


def weight_bytes_by_kind(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters by dtype, block-FP8 scales apart (a tied weight counted once; a CPU layer's
    packed copy counted in place of the weight it replaced)."""
    kinds: dict[str, int] = {}
    for param in model.parameters():  # each shared parameter once
        kind = getattr(param, "bytes_kind", None)  # packed formats name themselves (MXFP4 bytes and scales)
        if kind is None:
            kind = (
                "fp8 scales" if hasattr(param, "filled_shards") else str(param.dtype).removeprefix("torch.")
            )
        kinds[kind] = kinds.get(kind, 0) + param.numel() * param.element_size()
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if isinstance(packed, torch.Tensor) and getattr(module, "weight", None) is not None:
            if module.weight.numel() == 0:  # the packed copy replaced it
                kind = str(packed.dtype).removeprefix("torch.")
                kinds[kind] = (
                    kinds.get(kind, 0) + module.in_features * module.out_features * packed.element_size()
                )
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> LoadReport:
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {name: set() for name in params}
    report = LoadReport()
    for ckpt_name, tensor in weights:
        mapped = model.map_checkpoint_name(ckpt_name)
        if mapped is None:
            report.ignored += 1
            continue
        name, shard_id = mapped
        if name not in params:
            report.unexpected.append(ckpt_name)
            continue
        param = params[name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if not getattr(loader, "takes_slices", False):
            tensor = read(tensor).to(param.dtype)
        try:
            loader(param, tensor, shard_id)
        except ShapeMismatch as e:
            report.shape_mismatches.append(f"{ckpt_name} ({e})")
            continue
        loaded[name].add(shard_id)
        report.num_tensors += 1
        report.num_parameters += tensor.numel()
    for name, param in params.items():
        # block-FP8 scales made from a float weight as it loaded count as loaded (layers/fp8_params.py)
        made = getattr(param, "filled_shards", set())
        missing = getattr(param, "expected_shards", frozenset({None})) - loaded[name] - made
        if missing:
            shards = "" if missing == {None} else f" shards {sorted(missing, key=str)[:8]}"
            report.missing.append(name + shards)
    return report


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> LoadReport:
    """Random weights from the config alone (load_format="dummy"): for speed runs, never for answers."""
    generators: dict[torch.device, torch.Generator] = {}
    report = LoadReport()
    for name, param in model.named_parameters():
        gen = generators.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        kind = getattr(param, "bytes_kind", None)
        if kind == "mxfp4":  # random e2m1 codes (values up to 6) ...
            param.random_(0, 256, generator=gen)
        elif kind == "mxfp4 scales":  # ... times 2^-8: magnitudes near std
            param.fill_(127 - 8)
        elif not param.is_floating_point():
            pass  # integer tables (DeepSeek-V4's hash routing) keep the model's own construction
        elif hasattr(param, "filled_shards"):  # block-FP8 scales: unit-variance FP8 values times std
            param.fill_(std)
        elif param.element_size() == 1:  # FP8 weights: drawn in float32 a slice at a time, then cast
            for part in param.view(-1, param.shape[-1]).split(1 << 14):
                part.copy_(torch.randn(part.shape, generator=gen, device=param.device))
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("e_score_correction_bias") or name.endswith(".bias"):
            param.zero_()
        else:  # drawn where the parameter lives: a 16B-parameter model would take minutes through the CPU
            param.normal_(0.0, std, generator=gen)
        report.num_tensors += 1
        report.num_parameters += param.numel()
    return report

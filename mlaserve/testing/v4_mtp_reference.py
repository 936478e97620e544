"""The plain computation of DeepSeek-V4 MTP drafts, the reference for models/deepseek_v4_mtp.py run by
runner/mtp_draft.py: transformers' own V4 on the whole sequence, no cache.

For known tokens x_0..x_m, the main model's streams S_p after its last block (the input of its hc_head), at p < m.
The MTP layer's input at p is e_proj(enorm(embed(x_{p+1}))) + h_proj(hnorm(S_p)) on every stream; its block is
transformers' own decoder block, built as one more block of the same model (a sliding-window block with a
score-routed MoE) from the checkpoint's mtp.0.* tensors, and run over positions 0..p with the model's window mask;
head(norm(hc_head(out_p))) with the layer's own hc_head and norm predicts x_{p+2}. Draft j + 1 appends a row built
from draft j and the layer's own output streams at the row before, and reruns the layer over the whole sequence.
"""

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class V4MtpReference:
    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(path)
        self.main = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        cfg = self.main.config
        self.eps, n = cfg.rms_norm_eps, cfg.num_hidden_layers
        tensors = load_file(str(path / "model.safetensors"))
        own = {name[len("mtp.0.") :]: t for name, t in tensors.items() if name.startswith("mtp.0.")}
        # The block as block n of a model one block longer, which transformers loads from its own names.
        config = json.loads((path / "config.json").read_text())
        config |= {
            "num_hidden_layers": n + 1,
            "layer_types": [*cfg.layer_types, "sliding_attention"],
            "mlp_layer_types": [*cfg.mlp_layer_types, "moe"],
        }
        longer = {name: t for name, t in tensors.items() if not name.startswith("mtp.")}
        for rest, t in own.items():
            if rest.startswith(("attn.", "ffn.", "attn_norm.", "ffn_norm.", "hc_attn_", "hc_ffn_")):
                longer[f"model.layers.{n}.{rest}"] = t
        with tempfile.TemporaryDirectory() as folder:
            save_file(longer, f"{folder}/model.safetensors", metadata={"format": "pt"})
            Path(folder, "config.json").write_text(json.dumps(config))
            self.longer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.layer_index = n
        self.enorm, self.hnorm, self.norm = own["enorm.weight"], own["hnorm.weight"], own["norm.weight"]
        self.e_proj, self.h_proj = own["e_proj.weight"], own["h_proj.weight"]
        self.hc_head = type(self.main.model.hc_head)(cfg)
        self.hc_head.load_state_dict(
            {"hc_fn": own["hc_head_fn"], "hc_base": own["hc_head_base"], "hc_scale": own["hc_head_scale"]}
        )

    @staticmethod
    def _streams_into(model: torch.nn.Module) -> tuple[list, object]:
        """A hook that keeps the input of model's hc_head (the streams after its last block)."""
        seen: list[torch.Tensor] = []
        hook = model.model.hc_head.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
        return seen, hook

    @torch.no_grad()
    def main_streams(self, token_ids: list[int]) -> torch.Tensor:
        """[len, hc_mult, hidden]: the main model's streams after its last block."""
        seen, hook = self._streams_into(self.main)
        try:
            self.main(torch.tensor([token_ids]))
        finally:
            hook.remove()
        return seen[0][0]

    @torch.no_grad()
    def layer(self, next_ids: list[int], previous: torch.Tensor) -> torch.Tensor:
        """The MTP layer's output streams over positions 0..len-1 (its window's mask, no cache)."""
        embedded = self.main.model.embed_tokens(torch.tensor(next_ids))
        e = _rms(embedded, self.enorm, self.eps) @ self.e_proj.T
        x = e[:, None] + _rms(previous, self.hnorm, self.eps) @ self.h_proj.T

        def swap(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
            return (x[None], *args[1:]), kwargs  # the block's input: the layer's, not the blocks' before it

        block = self.longer.model.layers[self.layer_index]
        swapped = block.register_forward_pre_hook(swap, with_kwargs=True)
        seen, hook = self._streams_into(self.longer)
        try:
            self.longer(torch.tensor([next_ids]))
        finally:
            swapped.remove()
            hook.remove()
        return seen[0][0]

    @torch.no_grad()
    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self.main.lm_head(_rms(self.hc_head(streams[None])[0], self.norm, self.eps))

    def drafts(self, token_ids: list[int], k: int) -> list[int]:
        """The k drafts that follow token_ids (the whole known sequence)."""
        streams = self.main_streams(token_ids)[:-1]
        next_ids = list(token_ids[1:])
        out: list[int] = []
        for _ in range(k):
            last = self.layer(next_ids, streams)[-1]
            out.append(int(self.logits(last[None])[0].argmax()))
            next_ids.append(out[-1])
            streams = torch.cat((streams, last[None]))
        return out

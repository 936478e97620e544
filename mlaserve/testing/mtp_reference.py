"""The plain computation of DeepSeek MTP drafts, the reference for runner/mtp_draft.py: transformers' own model on
the whole sequence, no cache.

For known tokens x_0..x_m (x_m the newest), the main model's hidden states h_p before its final norm, at p < m. The
MTP layer's input at position p is eh_proj(cat(enorm(embed(x_{p+1})), hnorm(h_p))), its decoder layer attends
causally over positions 0..p, and head(shared_head.norm(out_p)) predicts x_{p+2}: out_{m-1} gives draft 1. Draft
j + 1 appends a row at position m - 1 + j built from draft j and out_{m-2+j} (the layer's own output) in place of
the main model's hidden state, and reruns the layer over the whole sequence.

With a window (the engine's training-free sliding_window and num_sink_tokens), every attention, the main model's and
the MTP layer's, sees only the last `window` positions up to its own and the first `sinks`: the same mask, given to
transformers as a 4-D attention mask.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def visible(n: int, window: int | None, sinks: int) -> torch.Tensor:
    """[n, n] True where the query at a row's position sees the key at a column's."""
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if window is None:
        return k <= q
    return (k <= q) & ((k > q - window) | (k < sinks))


class MtpReference:
    def __init__(self, path: Path, window: int | None = None, sinks: int = 0) -> None:
        self.window, self.sinks = window, sinks
        from transformers import AutoModelForCausalLM

        self.main = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        cfg = self.main.config
        self.eps, layer = cfg.rms_norm_eps, cfg.num_hidden_layers
        # The MTP layer's decoder layer, loaded by transformers as one more layer of the same model.
        longer = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, num_hidden_layers=layer + 1
        ).eval()
        self.block, self.rotary = longer.model.layers[layer], longer.model.rotary_emb
        tensors = load_file(str(Path(path) / "model.safetensors"))
        own = {
            n[len(f"model.layers.{layer}.") :]: t
            for n, t in tensors.items()
            if n.startswith(f"model.layers.{layer}.")
        }
        self.enorm, self.hnorm = own["enorm.weight"], own["hnorm.weight"]
        self.eh_proj, self.head_norm = own["eh_proj.weight"], own["shared_head.norm.weight"]

    @torch.no_grad()
    def main_hidden(self, token_ids: list[int]) -> torch.Tensor:
        """[len, hidden]: the main model's hidden states before its final norm."""
        seen = []
        hook = self.main.model.norm.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
        try:
            mask = visible(len(token_ids), self.window, self.sinks)[None, None]
            self.main(torch.tensor([token_ids]), attention_mask=mask)
        finally:
            hook.remove()
        return seen[0][0]

    @torch.no_grad()
    def layer(self, next_ids: list[int], previous: torch.Tensor) -> torch.Tensor:
        """The MTP layer's outputs (before shared_head.norm) over positions 0..len-1, causal, no cache."""
        n = len(next_ids)
        embedded = self.main.model.embed_tokens(torch.tensor(next_ids))
        joined = torch.cat((_rms(embedded, self.enorm, self.eps), _rms(previous, self.hnorm, self.eps)), -1)
        x = (joined @ self.eh_proj.T)[None]
        positions = torch.arange(n)[None]
        mask = torch.zeros(n, n).masked_fill(~visible(n, self.window, self.sinks), float("-inf"))[None, None]
        out = self.block(x, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(x, positions))  # fmt: skip
        return (out[0] if isinstance(out, tuple) else out)[0]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.main.lm_head(_rms(out, self.head_norm, self.eps))

    def drafts(self, token_ids: list[int], k: int) -> list[int]:
        """The k drafts that follow token_ids (the whole known sequence)."""
        hidden = self.main_hidden(token_ids)[:-1]
        next_ids = list(token_ids[1:])
        out: list[int] = []
        for _ in range(k):
            last = self.layer(next_ids, hidden)[-1]
            out.append(int(self.logits(last).argmax()))
            next_ids.append(out[-1])
            hidden = torch.cat((hidden, last[None]))
        return out

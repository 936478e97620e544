"""Greedy verification: which drafts the target model agrees with. Pure Python, shared by runner and tests."""

from __future__ import annotations


def greedy_accept(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a greedy step yields: drafts while each equals the target's argmax at its position, then the
    target's own token (at the first mismatch, or the bonus after every draft). targets: the argmax at each of
    len(drafts) + 1 positions, the first one being the position of the request's last known token."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"targets need one more entry ({len(drafts) + 1}) than drafts, got {len(targets)}")
    out = []
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        out.append(draft)
    out.append(targets[len(out)])
    return out

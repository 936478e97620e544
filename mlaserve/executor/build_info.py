"""What an executor built, and why, as its start-up log said it: read by whoever reports on the engine (the
server's start-up report) instead of working any choice out a second time."""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.loader.weights import LoadReport


@dataclass(frozen=True)
class BuildInfo:
    model: str | None  # the option as given; None: the default model
    architecture: str
    load: LoadReport
    attention_backend: str
    attention_backend_reason: str
    attention_kernel: str  # the decode kernel the backend runs for this model's shapes
    device: str
    max_model_len: int
    tensor_parallel_size: int
    expert_parallel: bool
    distributed: bool  # ranks in processes of their own
    rank_pids: tuple[int, ...]  # ranks past 0, when this process started them (not under a launcher)
    prefill_kernel: str = ""  # the prefill attention kernel for this model's shapes

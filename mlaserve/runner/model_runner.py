"""Runs one scheduled step: build the batch, forward, logits for the rows that finish a prompt or decode, sample."""

from dataclasses import dataclass

import torch

from mlaserve.attention.metadata import build_metadata
from mlaserve.core.scheduler import SchedulerOutput
from mlaserve.layers.sampler import Sampler
from mlaserve.models.base import CausalLM
from mlaserve.runner.batch import plan_batch, to_device


@dataclass(slots=True)
class StepResult:
    token_ids: dict[str, int]  # request id -> sampled token
    logprobs: dict[str, dict[int, float]]  # request id -> logprobs of this token (when asked for)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[torch.Tensor], block_size: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}  # per-request RNG so a seed fixes the output
        self.graphs = None  # DecodeGraphs, when enabled

    def enable_cuda_graphs(self, max_model_len: int, max_num_seqs: int) -> None:
        from mlaserve.runner.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, self.block_size, max_model_len, max_num_seqs, self.device
        )
        self.graphs.capture()

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, max_model_len: int) -> None:
        """One dummy prefill step of num_tokens (as prompts of at most max_model_len) through the whole model.

        Long prefills pick kernel variants that no decode graph uses (taller MoE tiles); without this the first
        long prompt a server sees would wait about a second per variant for Triton to compile it. Every dummy
        token writes to slot 0 of the null block, which no block table reads."""
        lens = [min(max_model_len, num_tokens - i) for i in range(0, num_tokens, max_model_len)]
        table = torch.zeros(
            len(lens), -(-max(lens) // self.block_size), dtype=torch.int32, device=self.device
        )
        slots = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        meta = build_metadata(self.block_size, table, lens, lens, 0, slots)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        self.model(
            torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions, self.kv_caches, meta
        )

    def add_generator(self, request_id: str, seed: int) -> None:
        self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)

    def drop_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        graphs = self.graphs
        host = plan_batch(output, self.block_size)
        if graphs is not None and graphs.can_run(host):
            logits = graphs.run(host)  # every decode row samples, in row order
        else:
            batch = to_device(host, self.block_size, self.device, with_gather_index=graphs is None)
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
            if not host.sampled:
                return StepResult({}, {})
            logits = self.model.compute_logits(hidden[batch.sample_rows])
        ids = [s.request.request_id for s in host.sampled]
        params = [s.request.sampling_params for s in host.sampled]
        result = self.sampler(logits, params, [self.generators.get(i) for i in ids])
        logprobs = {i: lp for i, lp in zip(ids, result.logprobs) if lp is not None}
        return StepResult(dict(zip(ids, result.token_ids)), logprobs)

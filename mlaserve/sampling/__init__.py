"""Sampling: logits processors (bias, penalties, grammar masks), the sampler, and structured output's grammars.

Below the runner, which calls them per step, and below the engine, which compiles each request's grammar; the
per-request settings themselves are mlaserve/sampling_params.py (the public `mlaserve.SamplingParams`).
"""

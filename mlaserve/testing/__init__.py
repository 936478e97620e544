"""Helpers that tests and benchmarks share: tiny random checkpoints (tiny_models) and random paged MLA caches
(paged_case). Not imported by the engine; importing mlaserve does not load them."""

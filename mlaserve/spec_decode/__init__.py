"""Speculative decoding: draft proposers (torch-free, so the scheduler can call them) and greedy acceptance."""

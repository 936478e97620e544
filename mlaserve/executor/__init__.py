"""The executor: the device, the tensor-parallel ranks, the model, its KV cache and the model runner.

The engine core (engine/core.py) schedules and keeps requests; everything that touches a device lives here, so
a rank past 0 (executor/worker.py) builds an executor alone and never an engine.
"""

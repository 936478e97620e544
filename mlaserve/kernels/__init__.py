"""GPU kernels' shared parts: tiles that fit the device they run on (fit.py)."""

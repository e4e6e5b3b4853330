"""Compilation: `spec.py` (the `Compile` spec), `hooks.py` (regional compile, CUDA-graph safety, whole-transformer graphs)."""

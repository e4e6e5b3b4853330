"""Compilation: `spec.py` (the `Compile` spec), `hooks.py` (the feature), `regional.py`, `cuda_graphs.py`,
`split_graphs.py`, `model_watch.py` (its parts) and the inductor passes."""

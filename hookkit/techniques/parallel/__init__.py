"""Context parallelism: `spec.py` (the `ContextParallel` spec), `hooks.py` (diffusers' `enable_parallelism`, the
split/gather checks, `FEATURE`)."""

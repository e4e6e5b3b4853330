"""DBCache residual caching: `spec.py` (the `DBCache` spec and step masks), `hooks.py` (hooks and `FEATURE`)."""

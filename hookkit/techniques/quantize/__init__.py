"""torchao quantization: `spec.py` (the `Quantize` spec), `torchao.py` (layer selection, `FEATURE`), `filters.py`."""

"""DBCache residual caching: `spec.py` (the `DBCache` spec and step masks), `calibration.py` (the planned rules'
arithmetic), `hooks.py` (hooks and `FEATURE`), `state.py` (layout, per-call state, decision rules),
`graph_bridge.py` (decisions under whole-transformer CUDA graphs) and `summary.py` (statistics, summary, plot)."""

"""The core: hook registry, method patches, mode scopes, scheduler listeners, plans, the handle and per-call
state, the feature contract and the compat table. It imports no technique: techniques plug in through
`hookkit.core.feature.Feature`, registered in `hookkit.features`."""

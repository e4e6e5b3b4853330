"""One folder or module per technique, each with its spec, its hooks and a `FEATURE` (the `Spec` field it is
named after): `cache` (DBCache), `quantize` (torchao), `compile` (regional compile, CUDA graphs), `memo`
(memoized index tensors), `sync_free` (a denoising loop without host syncs). No technique imports another."""

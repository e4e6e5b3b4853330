"""Tooling, imported on demand only (`import hookkit` loads none of it): the CLI, benchmarks, the quality harness, tiny pipelines (`zoo`) and the shipped trained tiny Flux."""

"""Benchmarks of bert_jax, by area; run from the repository root as `python -m benchmarks.<area>.<name>`
(benchmarks/RESULTS.md links each area's results). Not installed by `pip install`."""

"""Experiment configs: one `get_config()` per file; variants import `base` and override.

Run with `python -m bert_jax.main --config=configs/<name>.py --config.key=value`; from any folder
`--config=<name>` (or `configs/<name>.py`) is this package's file (bert_jax.config_overrides.resolve_config).
"""

"""Experiment configs: one `get_config()` per file; variants import `base` and override.

Run with `python -m bert_jax.main --config=configs/<name>.py --config.key=value`.
"""

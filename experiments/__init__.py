"""Studies, not timings: does pretraining with bert_jax help fine-tuning (English, Chinese)? Run from the
repository root as `python -m experiments.<name>`; results in experiments/RESULTS.md and experiments/results/."""

"""Fine-tuning a real pretrained encoder end to end, against transformers; a first run's profile."""

"""Data preparation and input: create_pretraining_data, its Beam runner, the tokenizer, the
input pipeline, verify_data."""

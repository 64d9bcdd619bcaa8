"""data_pipeline: text, tokens, TFRecords and tf.data for bert_jax.

This package never imports jax or bert_jax: preprocessing is a separate offline program
whose artifacts (vocab.txt, TFRecords + a `<run>.dataset_info.json` manifest per run) the trainer reads.
"""

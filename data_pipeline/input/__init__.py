"""Input: TFRecords -> host-local numpy batches for pretraining (tf.data).

The last stage of the data path: `masking.py` (dynamic masking, whole-word aware), `row_packing.py`
(several sequences a row) and `pretraining.py` (the training stream with its saved position, and
the padded evaluation pass), handed to `bert_jax.pretrain.feed`.

It imports `storage`, `tokenization` and `records` below it: never `pretraining_data`.
"""

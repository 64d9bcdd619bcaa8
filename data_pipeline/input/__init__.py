"""Input: TFRecords -> host-local numpy batches for pretraining (tf.data).

The last stage of the data path, handed to `bert_jax.pretrain.feed`:

  masking      dynamic masking, whole-word aware
  packing      several sequences a row (first fit within a window)
  parsing      serialized records -> tensors -> numpy batches, what the two below share
  pretraining  the training stream, with its saved and restored position
  evaluation   the padded evaluation pass, the same number of batches on every host

It imports `storage`, `tokenization` and `records` below it: never `pretraining_data`.
"""

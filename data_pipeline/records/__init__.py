"""Records: pretraining data as TFRecords in Google's schema, and what is known about them.

The stage between making the data (`pretraining_data`) and reading it for training (`input`):
`schema.py` (THE contract: feature names, dtypes, shapes; `to_tf_example`, `parse_example`),
`tfrecord.py` (the framing and CRC-32C, written without TensorFlow), `manifests.py` (one
`<run>.dataset_info.json` per run, written and read), `scan.py` (walking a damaged file's framing, record by record)
`reader.py` (which files a host reads, their check against the manifests, their tf.data reading)
and `known_hashes.py` (the files hashed before, trusted by identity instead of read again).

It imports only `storage` and `tf_import` below it: never `tokenization`, `pretraining_data` or `input`.
"""

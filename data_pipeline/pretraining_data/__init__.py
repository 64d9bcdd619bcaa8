"""Pretraining data: text documents -> training instances -> framed TFRecords, shard by shard.

The stage behind `python -m data_pipeline.create_pretraining_data`: `corpora.py` (document
readers), `instances.py` (Google's reference instances: segment pairs, NSP, masking),
`fast_instances.py` (the same records from numpy), `chinese_words.py` (the word segmentation
of `--chinese_whole_word_mask`), `shards.py` (one shard of the fast mode, shared by both runners)
and `beam_pipeline.py` (the Beam runner).

It imports `storage`, `tokenization` and `records` below it: never `input`.
"""

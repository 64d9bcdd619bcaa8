"""Fine-tuning on your own files: classification, regression, tagging (the kind after the colon).

    python -m bert_jax.main --config=configs/own_data.py:classification --workdir=W \\
        --config.init_checkpoint=CKPT --config.split_files.train=reviews.csv \\
        --config.task_options.text_column=review --config.task_options.dev_fraction=0.1

Kinds (data_pipeline/tasks/classification.py, tagging.py; docs/finetuning.md "Your own data"):

    classification   CSV / TSV / JSON Lines: one text or a pair -> a label (accuracy, macro-F1, MCC)
    regression       the same -> a number (Pearson, Spearman)
    tagging          CoNLL-style columns or JSON Lines of tokens and tags (BIO / BIOES, entity F1)

Splits: `config.split_files.{train,dev,test}` (or train.*, dev.*, test.* in `config.data_dir`); with
no dev file, `task_options.dev_fraction` of the training file (seeded by `split_seed`) is dev.
SQuAD-format JSON of your own: configs/squad.py with `config.split_files.train/dev`.
"""

import ml_collections

from configs import glue

KINDS = ("classification", "regression", "tagging")


def get_config(kind: str = "classification") -> ml_collections.ConfigDict:
    if kind not in KINDS:
        raise ValueError(f"--config=configs/own_data.py:KIND: KIND must be one of {KINDS}, got {kind!r}")
    config = glue.get_finetune_config()
    config.task = kind
    config.learning_rate = 2e-5
    config.num_train_epochs = 3.0
    shared = dict(
        dev_fraction=0.0,  # > 0 and no dev file: this share of the training file is dev (seeded)
        split_seed=0,  # seeds that draw (the same file splits the same way on every run and host)
        format="auto",  # auto (from the suffix) | csv | tsv | jsonl (tagging: auto | conll | jsonl)
        labels="",  # "" = discovered from the training file; else "neg,pos" (the head's order)
    )
    if kind in ("classification", "regression"):
        config.task_options = ml_collections.ConfigDict(dict(
            text_column="text",  # the text (its header name, or JSON Lines key)
            text_b_column="",  # the second text of a pair ("" = single texts)
            label_column="label",
            id_column="",  # "" = the row's line number is its id in the predictions
            primary_metric="",  # picks best/: accuracy | macro_f1 | mcc ("" = accuracy); pearson | spearman
            **shared))
        if kind == "regression":
            del config.task_options["labels"]
    else:
        config.max_seq_length = 128  # a longer sentence is cut into several rows at token boundaries
        config.learning_rate = 5e-5
        config.task_options = ml_collections.ConfigDict(dict(
            token_column=0,  # conll: the token's column
            tag_column=-1,  # conll: the tag's column (-1: the last)
            tokens_key="tokens",  # jsonl: the list of tokens
            tags_key="tags",  # jsonl: the list of tags, one per token
            id_key="",  # jsonl: a sentence id field ("" = its line number)
            tag_scheme="auto",  # auto | bio (IOB1/IOB2) | bioes
            text_tokens="words",  # mode=predict on plain text: words (split at spaces) | characters (Chinese)
            **shared))
    return config

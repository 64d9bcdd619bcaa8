"""Fine-tuning on SQuAD v1.1 (default) or v2.0 (`--config.task=squad_v2`), google-research/bert's setup.

    python -m bert_jax.main --config=configs/squad.py --config.data_dir=SQUAD_DIR \\
        --config.init_checkpoint=PATH --workdir=W

Paper: v1.1 3 epochs, lr 5e-5, batch 32; v2.0 2 epochs, lr 5e-5, batch 48
(`--config.task=squad_v2 --config.num_train_epochs=2 --config.global_batch_size=48`).
Writes W/predictions.json, W/nbest_predictions.json (and W/null_odds.json for v2).

google-research/bert's run_squad.py exactly (docs/finetuning.md, "Reproducing run_classifier.py /
run_squad.py"): `--config.optimizer=google_adamw --config.google_lr_schedule=True
--config.num_train_steps_from=examples`: int(questions / batch * epochs) steps over the windows.
Not the default (whole epochs over the windows, bias-corrected AdamW; configs/glue.py says why).
"""

import ml_collections

from configs import glue


def get_config() -> ml_collections.ConfigDict:
    config = glue.get_finetune_config()
    config.task = "squad_v1"  # squad_v1 | squad_v2
    config.max_seq_length = 384  # question + context window
    config.learning_rate = 5e-5
    config.num_train_epochs = 3
    config.global_batch_size = 32
    config.task_options = ml_collections.ConfigDict(dict(
        doc_stride=128,  # tokens between the starts of consecutive context windows
        max_query_length=64,  # question pieces kept
        n_best_size=20,  # top start/end logits searched, and n-best list length
        max_answer_length=30,  # longest answer, in word pieces
        null_score_diff_threshold=0.0,  # v2: predict "" when null - best span exceeds this (tune on dev)
        # Your own SQuAD-format file (config.split_files.train) and no dev file: this share of its
        # paragraphs (seeded by split_seed) is dev.
        dev_fraction=0.0,
        split_seed=0,
    ))
    return config

"""Fine-tuning on CoNLL-2003 NER (token classification on each word's first piece, no CRF).

    python -m bert_jax.main --config=configs/ner.py --config.data_dir=CONLL_DIR \\
        --config.init_checkpoint=PATH --workdir=W

Cased models suit NER (the paper's NER results use cased BERT). Scores dev and test after each
epoch (conlleval entity F1); predictions in conlleval's column format in W/.

Google's optimizer, schedule and step count (as run_classifier.py; Google released no script for
this task): `--config.optimizer=google_adamw --config.google_lr_schedule=True
--config.num_train_steps_from=examples` (docs/finetuning.md). Not the default (configs/glue.py).
"""

import ml_collections

from configs import glue


def get_config() -> ml_collections.ConfigDict:
    config = glue.get_finetune_config()
    config.task = "conll2003"
    config.max_seq_length = 128  # longer sentences are split at word boundaries into several rows
    config.learning_rate = 5e-5  # from the paper's grid {5e-5, 3e-5, 2e-5}
    config.num_train_epochs = 3
    config.global_batch_size = 32
    return config

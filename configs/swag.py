"""Fine-tuning on SWAG (multiple choice: four endings, softmax over their [CLS] scores).

    python -m bert_jax.main --config=configs/swag.py --config.data_dir=SWAG_DIR \\
        --config.init_checkpoint=PATH --workdir=W

Paper: 3 epochs, lr 2e-5, batch 16. SWAG_DIR holds train.csv, val.csv (and test.csv).

Google's optimizer, schedule and step count (as run_classifier.py; Google released no script for
this task): `--config.optimizer=google_adamw --config.google_lr_schedule=True
--config.num_train_steps_from=examples` (docs/finetuning.md). Not the default (configs/glue.py).
"""

import ml_collections

from configs import glue


def get_config() -> ml_collections.ConfigDict:
    config = glue.get_finetune_config()
    config.task = "swag"
    config.max_seq_length = 128  # per choice
    config.learning_rate = 2e-5
    config.num_train_epochs = 3
    config.global_batch_size = 16
    return config

"""The offline demo: from nothing to a pretrained tiny BERT guessing [MASK], on one CPU, no network.

`python -m bert_jax.main --config=configs/demo.py --workdir=/tmp/bert_demo`

1. writes the embedded corpus (documentation text that ships with Python) in Google's format;
2. trains a WordPiece vocabulary on it (sentencepiece underneath);
3. writes pre-masked TFRecords (+ their manifest) for training and a held-out evaluation set;
4. pretrains a tiny BERT with the ordinary loop (checkpoints, TensorBoard, resumable);
5. prints the model's top-5 guesses for the [MASK] in a few sentences.

Each stage is skipped when its output already exists, so an interrupted demo resumes.
"""

from __future__ import annotations

import json
import logging

import jax
import ml_collections

from bert_jax import layout
from bert_jax.pretrain import checkpoint_eval, loop as pretrain
from bert_jax.training import run_setup, sharding
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

PROMPTS = (
    "The function returns a [MASK] of the elements.",
    "An exception is [MASK] when the file does not exist.",
    "The [MASK] statement is used to import a module.",
    "Each thread has its own [MASK].",
)


def prepare_data(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Stages 1-3; returns the paths the pretraining config needs."""
    from data_pipeline import create_pretraining_data, train_vocab
    from data_pipeline.pretraining_data import corpora
    from data_pipeline.records import manifests

    d = config.demo
    corpus_dir = storage_paths.join(workdir, layout.DEMO_CORPUS)
    files = storage.glob(storage_paths.join(corpus_dir, "*.txt"))
    if not files:
        files = corpora.write_embedded_corpus(corpus_dir, num_shards=d.num_shards)
    train_files, eval_files = files[:-1], files[-1:]  # the last shard is held out

    vocab_file = storage_paths.join(workdir, layout.VOCAB)
    if not storage.exists(vocab_file):
        train_vocab.train_vocab(train_files, d.vocab_size, vocab_file, do_lower_case=True)

    out = {}
    for name, inputs, dupe in (("train", train_files, d.dupe_factor), ("eval", eval_files, 1)):
        out_dir = storage_paths.join(workdir, layout.DEMO_DATA, name)
        if not manifests.in_directory(out_dir, lenient=True):  # a manifest is written last: the records are whole
            create_pretraining_data.create_pretraining_data(
                input_files=inputs, output_dir=out_dir, vocab_file=vocab_file, do_lower_case=True,
                max_seq_length=config.max_seq_length,
                max_predictions_per_seq=config.max_predictions_per_seq,
                dupe_factor=dupe, random_seed=config.seed, num_workers=1)
        out[name] = storage_paths.join(out_dir, "*.tfrecord*")
    out["vocab_file"] = vocab_file
    return out


def fill_mask(params, bert_config, vocab_file: str, prompts=PROMPTS, top_k: int = 5) -> list[dict]:
    """Top-k guesses of the model for each [MASK] in each prompt (see `bert_jax.fill_mask`)."""
    from bert_jax import fill_mask as fm
    from data_pipeline import tokenization

    tok = tokenization.FullTokenizer(vocab_file, do_lower_case=True, keep_special_tokens=True)
    results = fm.fill_mask(params, bert_config, tok, prompts, top_k)
    return [{"prompt": r["text"], "tokens": r["tokens"], "guesses": r["guesses"]} for r in results]


def run(config: ml_collections.ConfigDict, workdir: str) -> list[dict]:
    storage.makedirs(workdir)
    paths = prepare_data(config, workdir)
    with storage.open(paths["vocab_file"], encoding="utf-8") as f:
        vocab_size = sum(1 for _ in f)
    config = config.copy_and_resolve_references()
    config.mode = "pretrain"
    config.train_data = paths["train"]
    config.eval_data = paths["eval"]
    config.vocab_file = paths["vocab_file"]
    config.model.vocab_size = vocab_size
    # A shortened demo (--config.num_train_steps=30) keeps a 10% warmup.
    config.warmup_steps = min(config.warmup_steps, config.num_train_steps // 10)
    metrics = pretrain.run(config, workdir)
    logging.info("final training metrics: %s", metrics)

    eval_config = config.copy_and_resolve_references()
    eval_config.init_checkpoint = workdir
    evaluation = checkpoint_eval.evaluate(eval_config, workdir)
    bert_config = run_setup.bert_config_from(eval_config)
    params, _ = run_setup.load_params(eval_config, bert_config, sharding.create_mesh(
        {"data": -1}, devices=jax.devices()[:1]))
    results = fill_mask(params, bert_config, paths["vocab_file"])
    if jax.process_index() == 0:
        print(f"\nheld-out masked-LM accuracy {evaluation['masked_lm_accuracy']:.3f}, "
              f"next-sentence accuracy {evaluation['next_sentence_accuracy']:.3f}")
        for r in results:
            for guesses in r["guesses"]:
                shown = ", ".join(f"{t} ({p:.2f})" for t, p in guesses)
                print(f"{r['prompt']}\n    [MASK] -> {shown}")
        storage.write_text(storage_paths.join(workdir, layout.FILL_MASK), json.dumps(results, indent=2))
        from bert_jax import plot
        curves = storage_paths.join(workdir, layout.CURVES)
        plot.plot(workdir, curves)
        print(f"\ntraining curves: {curves}  (python -m bert_jax.plot --workdir={workdir})")
    return results

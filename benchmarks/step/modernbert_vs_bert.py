"""ModernBERT's pretraining step against BERT's at equal parameters, at several lengths (issue 72).

    python -m benchmarks.step.modernbert_vs_bert [--lengths=128,512,1024 --batch=8 --hidden=256 --layers=6]

Both models are this project's (`bert_jax.model.modernbert`, `bert_jax.model.pretraining_heads`), shaped
to the same width, depth and heads; ModernBERT's GeGLU takes two thirds of BERT's intermediate size, so
its feed-forward has BERT's parameters (3 h i' = 2 h i), and the script prints both models' counts
(BERT also has position and segment embeddings, ModernBERT none). One step: the forward and backward
pass with the masked-LM loss on 15% of the positions (the same positions for both), and AdamW's update,
jitted, float32. Inputs are full rows (no padding): what is measured is the attention's cost, global on
every BERT layer, local (a `--local_attention` window, by blocks) on two of every three ModernBERT layers.
The variants alternate round by round (`benchmarks.common.variant_timing`), so both see the same load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common.variant_timing import time_alternating
from bert_jax.model import modernbert
from bert_jax.model.model_config import BertConfig
from bert_jax.model.modeling import count_params
from bert_jax.model.pretraining_heads import BertForPreTraining


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="128,512,1024")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=30522)
    p.add_argument("--local_attention", type=int, default=128, help="ModernBERT's window (ModernBERT-base: 128)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--band_too", action="store_true",
                   help="also time ModernBERT with local_blocks=False (the band mask over full attention)")
    p.add_argument("--json", default="", help="also write the results here")
    return p.parse_args(argv)


def mlm_loss(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def make_step(apply_logits, params):
    tx = optax.adamw(1e-4, weight_decay=0.01)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            return mlm_loss(apply_logits(p, batch), batch["labels"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = {"params": params, "opt": opt_state}

    def unit(batch):
        state["params"], state["opt"], loss = step(state["params"], state["opt"], batch)
        jax.block_until_ready(loss)
        return loss

    return unit


def models(args, max_length: int):
    bert_cfg = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                          max_position_embeddings=max_length, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    modern_cfg = modernbert.ModernBertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=(8 * args.hidden) // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, max_position_embeddings=max_length,
        local_attention=args.local_attention, pad_token_id=0)
    return bert_cfg, modern_cfg


def run(args) -> dict:
    lengths = [int(x) for x in args.lengths.split(",")]
    bert_cfg, modern_cfg = models(args, max(lengths))
    bert = BertForPreTraining(bert_cfg)
    modern = modernbert.ModernBertForMaskedLM(modern_cfg)
    results = {"machine": platform.processor() or platform.machine(), "jax": jax.__version__,
               "batch": args.batch, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
               "local_attention": args.local_attention, "rows": []}
    for length in lengths:
        rng = np.random.RandomState(length)
        preds = max(1, int(round(0.15 * length)))
        ids = rng.randint(5, args.vocab, size=(args.batch, length)).astype(np.int32)
        positions = np.sort(np.stack([rng.choice(length, preds, replace=False) for _ in range(args.batch)]), 1)
        batch = {"input_ids": jnp.asarray(ids), "input_mask": jnp.ones_like(ids), "segment_ids": jnp.zeros_like(ids),
                 "positions": jnp.asarray(positions.astype(np.int32)),
                 "labels": jnp.asarray(np.take_along_axis(ids, positions, 1))}
        bert_params = bert.init(jax.random.key(0), batch["input_ids"][:1], batch["input_mask"][:1],
                                batch["segment_ids"][:1], batch["positions"][:1])["params"]
        modern_params = modern.init(jax.random.key(0), batch["input_ids"][:1], batch["input_mask"][:1],
                                    masked_positions=batch["positions"][:1])["params"]

        def bert_logits(p, b):
            return bert.apply({"params": p}, b["input_ids"], b["input_mask"], b["segment_ids"], b["positions"]).mlm_logits

        def modern_logits(p, b):
            return modern.apply({"params": p}, b["input_ids"], b["input_mask"], masked_positions=b["positions"])[1]

        bert_step, modern_step = make_step(bert_logits, bert_params), make_step(modern_logits, modern_params)
        units = {"bert": lambda: bert_step(batch), "modernbert": lambda: modern_step(batch)}
        if args.band_too:
            band = modernbert.ModernBertForMaskedLM(dataclasses.replace(modern_cfg, local_blocks=False))
            band_step = make_step(lambda p, b: band.apply({"params": p}, b["input_ids"], b["input_mask"],
                                                          masked_positions=b["positions"])[1], modern_params)
            units["modernbert_band"] = lambda: band_step(batch)
        times = time_alternating(units, args.rounds, args.steps)
        row = {"length": length, "predictions": preds,
               "bert_params": count_params(bert_params), "modernbert_params": count_params(modern_params),
               "bert_ms": 1e3 * statistics.median(times["bert"]),
               "modernbert_ms": 1e3 * statistics.median(times["modernbert"])}
        row["speedup"] = row["bert_ms"] / row["modernbert_ms"]
        if args.band_too:
            row["modernbert_band_ms"] = 1e3 * statistics.median(times["modernbert_band"])
        results["rows"].append(row)
        print(f"length {length:5d}: BERT {row['bert_ms']:8.1f} ms ({row['bert_params']:,} params), ModernBERT "
              f"{row['modernbert_ms']:8.1f} ms ({row['modernbert_params']:,} params): {row['speedup']:.2f}x"
              + (f"; band mask {row['modernbert_band_ms']:8.1f} ms" if args.band_too else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def main(argv=None):
    run(parse_args(argv))


if __name__ == "__main__":
    main()

"""ModernBERT's pretraining step against BERT's at equal parameters, at several lengths (issue 72).

    python -m benchmarks.step.modernbert_vs_bert [--lengths=128,512,1024 --batch=8 --hidden=256 --layers=6]
        [--mixed_matmuls]   # each family also with bf16 matmuls, float32 out (config.cpu_bf16's path)

Both models are this project's (`bert_jax.model.modernbert`, `bert_jax.model.pretraining_heads`), shaped
to the same width, depth and heads; ModernBERT's GeGLU takes two thirds of BERT's intermediate size, so
its feed-forward has BERT's parameters (3 h i' = 2 h i), and the script prints both models' counts
(BERT also has position and segment embeddings, ModernBERT none). One step: the forward and backward
pass with the masked-LM loss on 15% of the positions (the same positions for both), and AdamW's update,
jitted, float32. Inputs are full rows (no padding): what is measured is the attention's cost, global on
every BERT layer, local (a `--local_attention` window, by blocks) on two of every three ModernBERT layers.
The variants alternate round by round (`benchmarks.common.variant_timing`), so both see the same load.

`--mixed_matmuls` times each family twice, float32 and with `mixed_matmuls` (every matmul with bfloat16
inputs and float32 accumulation and output, forward and backward: what `config.cpu_bf16="auto"` takes on
a CPU with bf16 units, `bert_jax.model.mixed_precision`), the four alternating; each row then gives the
best and the median step of every variant, each family's float32/mixed ratio of the medians, and the
load average (`os.getloadavg`) before and after its rounds: the machine may be shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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
    p.add_argument("--mixed_matmuls", action="store_true",
                   help="also time each family with mixed_matmuls (bf16 matmul inputs, float32 out)")
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
               "local_attention": args.local_attention, "mixed_matmuls": args.mixed_matmuls, "rows": []}
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
        if args.mixed_matmuls:
            units.update(mixed_units(bert_cfg, modern_cfg, bert_params, modern_params, batch))
        if args.band_too:
            band = modernbert.ModernBertForMaskedLM(dataclasses.replace(modern_cfg, local_blocks=False))
            band_step = make_step(lambda p, b: band.apply({"params": p}, b["input_ids"], b["input_mask"],
                                                          masked_positions=b["positions"])[1], modern_params)
            units["modernbert_band"] = lambda: band_step(batch)
        load_before = os.getloadavg()
        times = time_alternating(units, args.rounds, args.steps)
        row = {"length": length, "predictions": preds, "load_average": [load_before, os.getloadavg()],
               "bert_params": count_params(bert_params), "modernbert_params": count_params(modern_params),
               "bert_ms": 1e3 * statistics.median(times["bert"]),
               "modernbert_ms": 1e3 * statistics.median(times["modernbert"])}
        row["speedup"] = row["bert_ms"] / row["modernbert_ms"]
        if args.band_too:
            row["modernbert_band_ms"] = 1e3 * statistics.median(times["modernbert_band"])
        if args.mixed_matmuls:
            for name in ("bert", "bert_mixed", "modernbert", "modernbert_mixed"):
                row[f"{name}_min_ms"] = 1e3 * min(times[name])
            for name in ("bert", "modernbert"):
                row[f"{name}_mixed_ms"] = 1e3 * statistics.median(times[f"{name}_mixed"])
                row[f"{name}_mixed_speedup"] = row[f"{name}_ms"] / row[f"{name}_mixed_ms"]
        results["rows"].append(row)
        print(f"length {length:5d}: BERT {row['bert_ms']:8.1f} ms ({row['bert_params']:,} params), ModernBERT "
              f"{row['modernbert_ms']:8.1f} ms ({row['modernbert_params']:,} params): {row['speedup']:.2f}x"
              + (f"; band mask {row['modernbert_band_ms']:8.1f} ms" if args.band_too else ""), flush=True)
        if args.mixed_matmuls:
            print(f"             mixed matmuls: BERT {row['bert_mixed_ms']:8.1f} ms "
                  f"({row['bert_mixed_speedup']:.2f}x float32's), ModernBERT {row['modernbert_mixed_ms']:8.1f} ms "
                  f"({row['modernbert_mixed_speedup']:.2f}x); "
                  "best of each: " + ", ".join(f"{n} {row[n + '_min_ms']:.1f}" for n in (
                      "bert", "bert_mixed", "modernbert", "modernbert_mixed"))
                  + f" ms; load average {row['load_average'][0][0]:.1f} -> {row['load_average'][1][0]:.1f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def mixed_units(bert_cfg, modern_cfg, bert_params, modern_params, batch) -> dict:
    """The two families' steps with `mixed_matmuls`, from the float32 variants' initial parameters."""
    bert = BertForPreTraining(bert_cfg.replace(mixed_matmuls=True))
    modern = modernbert.ModernBertForMaskedLM(dataclasses.replace(modern_cfg, mixed_matmuls=True))
    bert_step = make_step(lambda p, b: bert.apply({"params": p}, b["input_ids"], b["input_mask"], b["segment_ids"],
                                                  b["positions"]).mlm_logits, bert_params)
    modern_step = make_step(lambda p, b: modern.apply({"params": p}, b["input_ids"], b["input_mask"],
                                                      masked_positions=b["positions"])[1], modern_params)
    return {"bert_mixed": lambda: bert_step(batch), "modernbert_mixed": lambda: modern_step(batch)}


def main(argv=None):
    run(parse_args(argv))


if __name__ == "__main__":
    main()

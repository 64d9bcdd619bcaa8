"""ModernBERT's local layers: the kernel's own window against the band mask, in the pretraining step (issue 72).

    python -m benchmarks.step.modernbert_local [--lengths=1024,8192 --batch_tokens=16384 --dtype=bfloat16]

ModernBERT-base's shape by default (22 layers, 768 wide, 12 heads, window 128), one step: forward and
backward with the masked-LM loss on 30% of the positions and AdamW's update, jitted
(`modernbert_vs_bert.make_step`), `attention_impl="dot_product"`, rows padded at random lengths (the
mask matters). Two variants from the same parameters and batch, their timed rounds alternating:

* `window`: `local_blocks=True`, what the model runs: each local layer's window goes to the kernel
  that takes it (`attention.local_kernel`: cuDNN's `local_window_size` on a GPU where cuDNN takes
  a two-sided window), else to the blocks (`attention.banded_attention`);
* `band`: `local_blocks=False`: the band mask ANDed into the full attention's mask (on a GPU cuDNN's
  fused kernel, with the band in its mask: every query scores every key).

Per length it prints and records which kernel the local layers got (`local_kernel`: "cudnn", "splash"
or none; jax 0.10.2 refuses cuDNN's two-sided window and logs why), each variant's step time, and how
far the two agree: the masked-LM logits of the first forward (the largest difference over the largest
logit) and the loss; `agree` is whether both are within `--tolerance` (rounding of `--dtype` alone), and
`resolves_one_key` whether that difference is below the control's: the band one key narrower on each
side against the band (in bfloat16 a window off by one key can hide in the rounding).
benchmarks/gpu/modernbert_local.sh runs it on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common.variant_timing import time_alternating
from benchmarks.step.modernbert_vs_bert import make_step, mlm_loss
from bert_jax.model import attention, modernbert


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,8192")
    p.add_argument("--batch_tokens", type=int, default=16384, help="rows per step: batch_tokens // length")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=1152)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50368)
    p.add_argument("--local_attention", type=int, default=128, help="the window (ModernBERT-base: 128)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--masked", type=float, default=0.3, help="masked-LM positions, a fraction of the length")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="largest logit difference over the largest logit, and relative loss difference")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    for length in lengths:
        if length < 1 or args.batch_tokens < length:
            p.error(f"--lengths: {length} needs --batch_tokens >= it (got {args.batch_tokens})")
    if args.local_attention < 4:
        p.error(f"--local_attention {args.local_attention}: at least 4 (the control narrows it by 2)")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} does not divide by --heads {args.heads}")
    args.lengths = lengths
    return args


def model_config(args, length: int, local_blocks: bool, local_attention: int = 0) -> modernbert.ModernBertConfig:
    return modernbert.ModernBertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, max_position_embeddings=length,
        local_attention=local_attention or args.local_attention, pad_token_id=0, dtype=args.dtype,
        attention_impl="dot_product", local_blocks=local_blocks)


def make_batch(args, length: int) -> dict:
    """Rows of 3/4 to all of `length` real tokens, then padding; masked positions among the real ones."""
    rng = np.random.RandomState(length)
    rows = args.batch_tokens // length
    real = rng.randint(3 * length // 4, length + 1, size=rows)
    input_mask = (np.arange(length)[None] < real[:, None]).astype(np.int32)
    ids = rng.randint(5, args.vocab, size=(rows, length)).astype(np.int32) * input_mask
    preds = max(1, int(round(args.masked * 3 * length / 4)))
    positions = np.sort(np.stack([rng.choice(n, preds, replace=False) for n in real]), 1).astype(np.int32)
    return {"input_ids": jnp.asarray(ids), "input_mask": jnp.asarray(input_mask),
            "positions": jnp.asarray(positions), "labels": jnp.asarray(np.take_along_axis(ids, positions, 1))}


def local_kernel_of(config: modernbert.ModernBertConfig, batch: dict) -> str:
    """What `attention.local_kernel` picks for a local layer's query at this batch's shape ("none": the
    blocks or the band mask)."""
    rows, length = batch["input_ids"].shape
    query = jax.ShapeDtypeStruct((rows, length, config.num_attention_heads, config.head_dim), config.compute_dtype)
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    return attention.local_kernel(query, config.local_attention // 2, config.attention_impl, ids) or "none"


def run(args) -> dict:
    logging.basicConfig(level=logging.WARNING)  # the probe's refusal, if cuDNN refuses the window
    results = {"machine": platform.processor() or platform.machine(), "devices": str(jax.devices()),
               "jax": jax.__version__, "dtype": args.dtype, "layers": args.layers, "hidden": args.hidden,
               "heads": args.heads, "local_attention": args.local_attention, "rows": []}
    for length in args.lengths:
        batch = make_batch(args, length)
        configs = {"window": model_config(args, length, True), "band": model_config(args, length, False)}
        kernel = local_kernel_of(configs["window"], batch)
        params = jax.jit(lambda: modernbert.ModernBertForMaskedLM(configs["band"]).init(
            jax.random.key(0), batch["input_ids"][:1], batch["input_mask"][:1],
            masked_positions=batch["positions"][:1])["params"])()
        logits, units = {}, {}
        for name, config in configs.items():
            model = modernbert.ModernBertForMaskedLM(config)

            def apply_logits(p, b, model=model):
                return model.apply({"params": p}, b["input_ids"], b["input_mask"], masked_positions=b["positions"])[1]

            logits[name] = np.asarray(jax.jit(apply_logits)(params, batch), np.float32)
            step = make_step(apply_logits, params)
            units[name] = lambda step=step: step(batch)
        # The control: the band one key narrower on each side, forward only. A comparison that cannot tell
        # it from the band (at `--dtype`'s rounding) could not see a window off by one either.
        narrower = modernbert.ModernBertForMaskedLM(model_config(args, length, False, args.local_attention - 2))
        logits["control"] = np.asarray(jax.jit(lambda p, b: narrower.apply(
            {"params": p}, b["input_ids"], b["input_mask"], masked_positions=b["positions"])[1])(params, batch),
            np.float32)
        losses = {name: float(mlm_loss(jnp.asarray(x), batch["labels"])) for name, x in logits.items()}
        scale = float(np.abs(logits["band"]).max())
        logit_diff = float(np.abs(logits["window"] - logits["band"]).max()) / max(scale, 1e-6)
        control_diff = float(np.abs(logits["control"] - logits["band"]).max()) / max(scale, 1e-6)
        loss_diff = abs(losses["window"] - losses["band"]) / max(abs(losses["band"]), 1e-6)
        times = time_alternating(units, args.rounds, args.steps)
        row = {"length": length, "rows": int(batch["input_ids"].shape[0]), "local_kernel": kernel,
               "window_ms": 1e3 * statistics.median(times["window"]),
               "band_ms": 1e3 * statistics.median(times["band"]),
               "logit_diff_rel": logit_diff, "loss_window": losses["window"], "loss_band": losses["band"],
               "agree": bool(logit_diff <= args.tolerance and loss_diff <= args.tolerance),
               "control_diff_rel": control_diff, "resolves_one_key": bool(logit_diff < control_diff)}
        row["band_over_window"] = row["band_ms"] / row["window_ms"]
        results["rows"].append(row)
        print(f"length {length:5d} x {row['rows']} rows: local layers on {kernel!r}: "
              f"window {row['window_ms']:8.1f} ms, "
              f"band mask {row['band_ms']:8.1f} ms ({row['band_over_window']:.2f}x); logits differ by "
              f"{logit_diff:.2e} of the largest (a window one key narrower: {control_diff:.2e}), "
              f"losses {losses['window']:.5f} / {losses['band']:.5f}: "
              f"{'agree' if row['agree'] else 'DISAGREE'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def main(argv=None):
    results = run(parse_args(argv))
    if not all(row["agree"] for row in results["rows"]):
        raise SystemExit("the window and the band mask disagree (see the rows above)")


if __name__ == "__main__":
    main()

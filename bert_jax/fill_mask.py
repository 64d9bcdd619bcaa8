"""Fill in the blank: a pretrained BERT's top-k guesses for each [MASK] in a text.

    python -m bert_jax.fill_mask --init_checkpoint=uncased_L-12_H-768_A-12 \\
        --text="The capital of France is [MASK]." [--text=...] [--top_k=5]

`--init_checkpoint` is any format `bert_jax.convert` reads; it needs the masked-LM head (encoder-only
checkpoints such as sentence encoders have none: the error says so). `[MASK]` typed in the text
stays one token (`keep_special_tokens`); the text is [CLS] text [SEP], one segment.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

import numpy as np


def fill_mask(params: dict, bert_config, tokenizer, texts: Sequence[str], top_k: int = 5) -> list[dict]:
    """`[{"text", "tokens", "guesses": [[(token, probability), ...] per [MASK]]}]`."""
    if top_k < 1:
        raise ValueError(f"top_k={top_k} must be at least 1")
    import jax
    from bert_jax.model.pretraining_heads import BertForPreTraining

    # In the model's dtype: FP8 is pretraining's (its scaling state lives in the train state, not in
    # `params`), as the pretraining loop's evaluations run (a demo's FP8 config reaches here).
    model = BertForPreTraining(bert_config.replace(fp8=False))
    import jax.numpy as jnp
    apply = jax.jit(lambda p, ids, pos: model.apply({"params": p}, ids, jnp.ones_like(ids), jnp.zeros_like(ids), pos))
    results = []
    for text in texts:
        tokens = ["[CLS]"] + tokenizer.tokenize(text) + ["[SEP]"]
        positions = [i for i, t in enumerate(tokens) if t == "[MASK]"]
        if not positions:
            raise ValueError(f"no [MASK] in {text!r}")
        if len(tokens) > bert_config.max_position_embeddings:
            raise ValueError(f"{text[:40]!r}...: {len(tokens)} tokens exceed the model's "
                             f"max_position_embeddings={bert_config.max_position_embeddings}")
        ids = np.array([tokenizer.convert_tokens_to_ids(tokens)], np.int32)
        out = apply(params, ids, np.array([positions], np.int32))
        probs = np.asarray(jax.nn.softmax(out.mlm_logits[0], axis=-1))  # [masks, vocab]
        guesses = []
        for row in probs:
            best = np.argsort(-row)[:top_k]
            guesses.append([(tokenizer.inv_vocab[int(i)], float(row[i])) for i in best])
        results.append({"text": text, "tokens": tokens, "guesses": guesses})
    return results


def load(init_checkpoint: str, vocab_file: Optional[str] = None, do_lower_case: Optional[bool] = None,
         google_gelu: Optional[str] = None):
    """(params, BertConfig, tokenizer) for `fill_mask` from a checkpoint in any format (`google_gelu`:
    what a Google checkpoint's "gelu" is, "erf" by default or "tanh"; docs/checkpoints.md)."""
    from bert_jax import convert
    from data_pipeline import tokenization

    p = convert.load_pretrained(init_checkpoint, google_gelu=google_gelu)
    if "mlm" not in p.params:
        raise ValueError(f"{init_checkpoint} has no masked-LM head (an encoder-only checkpoint): "
                         f"fill-in-the-blank needs one")
    vocab_file = vocab_file or p.vocab_file
    if not vocab_file:
        raise ValueError(f"{init_checkpoint} has no vocab.txt: pass vocab_file / --vocab_file")
    lower = do_lower_case if do_lower_case is not None else (p.do_lower_case if p.do_lower_case is not None else True)
    if p.do_lower_case is not None and lower != p.do_lower_case:
        from absl import logging
        logging.warning("do_lower_case=%s but %s is %s: guesses will be poor", lower, init_checkpoint,
                        "uncased" if p.do_lower_case else "cased")
    tokenizer = tokenization.FullTokenizer(vocab_file, do_lower_case=lower, keep_special_tokens=True)
    tokenization.require_tokens(tokenizer.vocab, vocab_file, ("[CLS]", "[SEP]", "[MASK]"))
    return convert.model_params(p), p.config, tokenizer


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bert_jax.fill_mask", description=__doc__.splitlines()[0])
    parser.add_argument("--init_checkpoint", required=True)
    parser.add_argument("--text", action="append", required=True, help="text with [MASK]; repeatable")
    parser.add_argument("--top_k", type=int, default=5, help="guesses per [MASK] (>= 1)")
    parser.add_argument("--vocab_file", default=None)
    parser.add_argument("--do_lower_case", choices=("true", "false"), default=None)
    parser.add_argument("--google_gelu", choices=("erf", "tanh"), default=None,
                        help="a Google checkpoint's \"gelu\": erf (default: the 2018 releases) or tanh")
    parser.add_argument("--cpu_bf16", choices=("auto", "on", "off"), default="auto",
                        help="on a CPU: matmuls with bf16 inputs and float32 outputs, the rest float32 (auto: "
                             "where the CPU has bf16 units and a timed matmul is faster)")
    args = parser.parse_args(argv)
    if args.top_k < 1:
        parser.error(f"--top_k={args.top_k} must be at least 1")
    lower = None if args.do_lower_case is None else args.do_lower_case == "true"
    from data_pipeline.storage import paths as storage_paths
    try:  # before anything is read: a path no backend handles, named by its flag
        storage_paths.check(args.init_checkpoint, "--init_checkpoint", urls=True)
        if args.vocab_file:
            storage_paths.check(args.vocab_file, "--vocab_file")
        params, config, tokenizer = load(args.init_checkpoint, args.vocab_file, lower, args.google_gelu)
        from bert_jax.training import cpu_bf16
        config = cpu_bf16.for_checkpoint(config, args.cpu_bf16)
        results = fill_mask(params, config, tokenizer, args.text, args.top_k)
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, not a traceback
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    for r in results:
        print(r["text"])
        for guesses in r["guesses"]:
            print("    [MASK] -> " + ", ".join(f"{t} ({p:.3f})" for t, p in guesses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

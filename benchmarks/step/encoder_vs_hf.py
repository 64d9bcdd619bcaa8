"""Encoder-only forward+backward: ours vs HuggingFace's FlaxBertModel, same process, same inputs.

    python -m benchmarks.step.encoder_vs_hf [--config=base|large] [--batch=4] [--seq_len=128] [--scan] [--rounds=4]

Isolates the encoder from the heads, the optimizer and dropout (both dropouts 0): the gradient of
sum(sequence_output**2) with respect to every parameter, jitted, timed in alternating rounds.
Explains where `benchmarks.step.pretrain_step`'s ratio comes from (on CPU: the MLM head, not the encoder).
"""

import argparse
import statistics
import time



def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="base", choices=["base", "large"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--scan", action="store_true")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import transformers
    from bert_jax.model.model_config import BertConfig
    from bert_jax.model.modeling import BertModel

    shape = {"base": (12, 768, 12), "large": (24, 1024, 16)}[args.config]
    cfg = BertConfig(num_hidden_layers=shape[0], hidden_size=shape[1], num_attention_heads=shape[2],
                     intermediate_size=4 * shape[1], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     scan_layers=args.scan)
    ids = jnp.asarray(np.random.default_rng(0).integers(5, cfg.vocab_size, (args.batch, args.seq_len)), jnp.int32)
    mask, seg = jnp.ones_like(ids), jnp.zeros_like(ids)
    ours = BertModel(cfg)
    params = ours.init(jax.random.key(0), ids)["params"]
    hf = transformers.FlaxBertModel(transformers.BertConfig(
        num_hidden_layers=shape[0], hidden_size=shape[1], num_attention_heads=shape[2],
        intermediate_size=4 * shape[1], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), seed=0)
    grad_ours = jax.jit(jax.grad(lambda p: jnp.sum(ours.apply({"params": p}, ids, mask, seg).sequence_output ** 2)))
    grad_hf = jax.jit(jax.grad(lambda p: jnp.sum(hf(ids, mask, seg, params=p).last_hidden_state ** 2)))
    jax.block_until_ready(grad_ours(params))
    jax.block_until_ready(grad_hf(hf.params))
    t_ours, t_hf = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        jax.block_until_ready(grad_ours(params))
        t_ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(grad_hf(hf.params))
        t_hf.append(time.perf_counter() - t)
    a, b = statistics.median(t_ours), statistics.median(t_hf)
    print(f"{jax.devices()[0].device_kind}: BERT-{args.config} encoder fwd+bwd, batch {args.batch} x {args.seq_len}: "
          f"ours {a * 1e3:.0f} ms, HF {b * 1e3:.0f} ms, ours is {b / a:.3f}x")


if __name__ == "__main__":
    main()

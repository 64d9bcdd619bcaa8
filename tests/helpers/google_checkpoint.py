"""A random Google BERT checkpoint (2 layers, hidden 16, vocab 40), written by TF1's own `Saver` from
names typed out of the issue's list (not from `bert_jax.formats.google`'s table), and the imported
model run on a small batch: tests/formats/test_convert.py (Google TF1, the CLI) and
test_convert_hf.py (HuggingFace) convert it. TensorFlow is imported only to write the checkpoint."""

import json
import os

import jax.numpy as jnp
import numpy as np

from bert_jax import convert
from bert_jax.model.modeling import BertModel
from bert_jax.model.pretraining_heads import BertForPreTraining
from tests.helpers import tiny_bert_inputs

V, H, NH, I, L, P = 40, 16, 4, 32, 2, 24
GOOGLE_CONFIG = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                     intermediate_size=I, hidden_act="gelu", hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1, max_position_embeddings=P, type_vocab_size=2,
                     initializer_range=0.02)


def google_variables(seed=0, heads=True):
    """Every variable of a Google BERT checkpoint, random (biases and LayerNorms included)."""
    rng = np.random.default_rng(seed)

    def r(*shape, scale=0.2):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    v = {"bert/embeddings/word_embeddings": r(V, H, scale=1.0),
         "bert/embeddings/token_type_embeddings": r(2, H, scale=1.0),
         "bert/embeddings/position_embeddings": r(P, H, scale=1.0)}

    def norm(name):
        v[name + "/gamma"] = 1.0 + r(H)
        v[name + "/beta"] = r(H)

    def dense(name, n_in, n_out):
        v[name + "/kernel"] = r(n_in, n_out, scale=1 / np.sqrt(n_in))
        v[name + "/bias"] = r(n_out)

    norm("bert/embeddings/LayerNorm")
    for i in range(L):
        p = f"bert/encoder/layer_{i}/"
        for n in ("query", "key", "value"):
            dense(p + "attention/self/" + n, H, H)
        dense(p + "attention/output/dense", H, H)
        norm(p + "attention/output/LayerNorm")
        dense(p + "intermediate/dense", H, I)
        dense(p + "output/dense", I, H)
        norm(p + "output/LayerNorm")
    dense("bert/pooler/dense", H, H)
    if heads:
        dense("cls/predictions/transform/dense", H, H)
        norm("cls/predictions/transform/LayerNorm")
        v["cls/predictions/output_bias"] = r(V)
        v["cls/seq_relationship/output_weights"] = r(2, H)
        v["cls/seq_relationship/output_bias"] = r(2)
    return v


def write_tf1_checkpoint(directory, variables, extra=True):
    """A Google-style checkpoint written by TF1's Saver (graph mode), as google-research/bert did."""
    import tensorflow as tf

    os.makedirs(directory, exist_ok=True)
    with tf.Graph().as_default():
        for name, value in variables.items():
            tf.compat.v1.get_variable(name, initializer=tf.constant(value))
        if extra:  # what a training checkpoint also holds
            tf.compat.v1.get_variable("global_step", initializer=tf.constant(1000, tf.int64))
            tf.compat.v1.get_variable("bert/pooler/dense/kernel/adam_m", initializer=tf.zeros((H, H)))
            tf.compat.v1.get_variable("output_weights", initializer=tf.zeros((3, H)))  # a classifier head
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, os.path.join(directory, "bert_model.ckpt"))
    with open(os.path.join(directory, "bert_config.json"), "w") as f:
        json.dump(GOOGLE_CONFIG, f)
    with open(os.path.join(directory, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(V - 5)]) + "\n")


def inputs(seed=1):
    """(input_ids, input_mask, segment_ids, masked_lm_positions): tests/helpers/tiny_bert_inputs.py's."""
    return tiny_bert_inputs.inputs(V, seed)


def run_ours(pretrained, ids, mask, seg, positions):
    """The pretraining model of a `convert.Pretrained` on a batch."""
    model = BertForPreTraining(pretrained.config)
    out = model.apply({"params": convert.model_params(pretrained)}, jnp.asarray(ids), jnp.asarray(mask),
                      jnp.asarray(seg), jnp.asarray(positions))
    return out


def run_encoder(pretrained, ids, mask, seg):
    """The last layer at every position (the pretraining model computes the masked ones only)."""
    return BertModel(pretrained.config).apply({"params": convert.model_params(pretrained)["bert"]},
                                              jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(seg))

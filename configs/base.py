"""BERT-Base (L=12, H=768, A=12), pretrained as in the paper (Devlin et al. 2018, Appendix A.2).

Every other config imports this one and overrides what differs.
"""

import ml_collections


def get_model_config(num_layers=12, hidden=768, heads=12) -> ml_collections.ConfigDict:
    """The fields of `bert_jax.modeling.BertConfig` for a published shape (feed-forward 4H)."""
    m = ml_collections.ConfigDict()
    m.vocab_size = 30522  # WordPiece vocabulary size (the released uncased vocab)
    m.hidden_size = hidden  # H
    m.num_hidden_layers = num_layers  # L
    m.num_attention_heads = heads  # A (head size H/A)
    m.intermediate_size = 4 * hidden  # feed-forward size, 4H
    m.hidden_act = "gelu"  # "gelu" = exact erf GELU; "gelu_tanh" = Google TF1's approximation
    m.hidden_dropout_prob = 0.1  # dropout on embeddings and every residual branch
    m.attention_probs_dropout_prob = 0.1  # dropout on attention probabilities
    m.max_position_embeddings = 512  # learned positions
    m.type_vocab_size = 2  # segments A and B
    m.initializer_range = 0.02  # stddev of the truncated-normal init
    m.layer_norm_eps = 1e-12  # LayerNorm epsilon (Google's)
    m.dtype = "float32"  # compute dtype; "bfloat16" on GPU/TPU
    m.param_dtype = "float32"  # parameter storage dtype
    m.scan_layers = False  # nn.scan over layers (compile time flat in depth)
    m.remat_policy = "none"  # none | full | dots | dots_no_batch
    m.attention_impl = "einsum"  # einsum | dot_product (cuDNN fused attention on GPU)
    m.vocab_pad_multiple = 128  # pad the MLM decoder's vocab dim for speed (params keep real size)
    m.causal_attention = False  # left-to-right encoder (paper Table 5 ablation)
    return m


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = get_model_config()
    config.seed = 42  # seeds init, dropout and data order
    # --- pretraining (paper: batch 256, 1M steps, Adam lr 1e-4, warmup 10k, decay 0.01) ---
    config.max_seq_length = 128  # phase 1 sequence length (the paper's 90% of steps)
    config.max_predictions_per_seq = 20  # masked-LM predictions per sequence at length 128
    config.global_batch_size = 256  # sequences per step, over all hosts
    config.num_train_steps = 1_000_000  # optimizer steps
    config.learning_rate = 1e-4  # peak learning rate
    config.warmup_steps = 10_000  # linear warmup, then linear decay to 0
    config.weight_decay = 0.01  # decoupled weight decay (not on LayerNorm or biases)
    return config

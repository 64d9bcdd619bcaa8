"""BERT-Tiny (L=2, H=128, A=2), one of the 24 smaller models of Turc et al. 2019 (google-research/bert)."""

from configs import base


def get_config():
    config = base.get_config()
    config.model = base.get_model_config(num_layers=2, hidden=128, heads=2)
    return config

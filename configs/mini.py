"""BERT-Mini (L=4, H=256, A=4), one of the 24 smaller models of Turc et al. 2019 (google-research/bert)."""

from configs import base


def get_config():
    config = base.get_config()
    config.model = base.get_model_config(num_layers=4, hidden=256, heads=4)
    return config

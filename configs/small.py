"""BERT-Small (L=4, H=512, A=8), one of the 24 smaller models of Turc et al. 2019 (google-research/bert)."""

from configs import base


def get_config():
    config = base.get_config()
    config.model = base.get_model_config(num_layers=4, hidden=512, heads=8)
    return config

"""BERT-Large (L=24, H=1024, A=16): 336,226,108 parameters with the pretraining heads."""

from configs import base


def get_config():
    config = base.get_config()
    config.model = base.get_model_config(num_layers=24, hidden=1024, heads=16)
    return config

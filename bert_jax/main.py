"""Entry point: `python -m bert_jax.main --config=configs/<name>.py --workdir=DIR [--config.x=y]`.

Thin on purpose: flags, multi-host initialization, dispatch on `config.mode`. The config file is
executed as Python (ml_collections); `--config.key=value` overrides are parsed safely.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (Python, get_config()).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, logs and results go here.")
_MULTIHOST = flags.DEFINE_enum(
    "multihost", "auto", ["auto", "true", "false"],
    "Call jax.distributed.initialize: auto = when BERT_JAX_COORDINATOR is set (local multi-process, "
    "see launch/local_multihost.sh) or on a multi-host Cloud TPU VM.")
flags.mark_flags_as_required(["config", "workdir"])


def init_distributed(mode: str) -> None:
    import jax
    coordinator = os.environ.get("BERT_JAX_COORDINATOR")
    tpu_pod = "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if mode == "false" or (mode == "auto" and not coordinator and not tpu_pod):
        return
    if coordinator:  # explicit: N local processes on 127.0.0.1, or a GPU cluster
        jax.distributed.initialize(
            coordinator, int(os.environ["BERT_JAX_NUM_PROCESSES"]), int(os.environ["BERT_JAX_PROCESS_ID"]),
            initialization_timeout=int(os.environ.get("BERT_JAX_INIT_TIMEOUT", "300")),
            heartbeat_timeout_seconds=int(os.environ.get("BERT_JAX_HEARTBEAT_TIMEOUT", "100")))
    else:  # Cloud TPU VMs (and SLURM/Open MPI clusters) are detected by jax itself
        jax.distributed.initialize()
    logging.info("process %d of %d", jax.process_index(), jax.process_count())


def main(argv):
    del argv
    config = _CONFIG.value
    init_distributed(_MULTIHOST.value)
    if config.mode == "pretrain":
        from bert_jax import pretrain
        pretrain.run(config, _WORKDIR.value)
    elif config.mode == "evaluate":
        from bert_jax import pretrain
        print(pretrain.evaluate(config, _WORKDIR.value))
    elif config.mode == "demo":
        from bert_jax import demo
        demo.run(config, _WORKDIR.value)
    else:
        raise app.UsageError(f"config.mode must be pretrain, evaluate or demo, got {config.mode!r}")


if __name__ == "__main__":
    app.run(main)

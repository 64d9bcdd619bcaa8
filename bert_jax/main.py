"""Entry point: `python -m bert_jax.main --config=configs/<name>.py --workdir=DIR [--config.x=y]`.

`--config` is a config file or, from any folder, the name of a module of the installed `configs`
package (`--config=base`, `--config=configs/base.py`, `--config=own_data:tagging`): see
`config_overrides.resolve_config`.

Thin on purpose: flags, multi-host initialization, dispatch on `config.mode`. The config file is
executed as Python (ml_collections); `--config.key=value` overrides are parsed safely.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from bert_jax import exit_codes

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (Python, get_config()), or a config's name (base, glue, ...; see configs/).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, logs and results go here.")
_MULTIHOST = flags.DEFINE_enum(
    "multihost", "auto", ["auto", "true", "false"],
    "Call jax.distributed.initialize: auto = when BERT_JAX_COORDINATOR is set (local multi-process, "
    "see launch/local_multihost.sh), on a multi-host Cloud TPU VM, or in a SLURM job or Open MPI "
    "run of more than one task.")
flags.mark_flags_as_required(["config", "workdir"])


def cluster_tasks() -> int:
    """Tasks of the SLURM job step (srun) or Open MPI run (mpirun) this process belongs to, else 0.

    jax.distributed.initialize() finds the coordinator and this task's rank in both itself; a
    single task trains alone without it.
    """
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1 and (not var.startswith("SLURM") or "SLURM_PROCID" in os.environ):
            return int(value)
    return 0


def init_distributed(mode: str) -> None:
    import jax
    coordinator = os.environ.get("BERT_JAX_COORDINATOR")
    tpu_pod = "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if mode == "false" or (mode == "auto" and not coordinator and not tpu_pod and not cluster_tasks()):
        return
    # The same bounds on both paths: a host that never joins, or one that stops answering, ends
    # the run within these many seconds instead of hanging it.
    timeouts = dict(initialization_timeout=int(os.environ.get("BERT_JAX_INIT_TIMEOUT", "300")),
                    heartbeat_timeout_seconds=int(os.environ.get("BERT_JAX_HEARTBEAT_TIMEOUT", "100")))
    if coordinator:  # explicit: N local processes on 127.0.0.1, or a GPU cluster
        jax.distributed.initialize(
            coordinator, int(os.environ["BERT_JAX_NUM_PROCESSES"]), int(os.environ["BERT_JAX_PROCESS_ID"]),
            **timeouts)
    else:  # Cloud TPU VMs (and SLURM/Open MPI clusters) are detected by jax itself
        jax.distributed.initialize(**timeouts)
    logging.info("process %d of %d", jax.process_index(), jax.process_count())


class _QuietLibraries:
    """Drops INFO chatter of orbax and tf.data from the console; warnings and errors still show."""

    def filter(self, record) -> bool:
        noisy = any(p in record.pathname for p in ("/orbax/", "/tensorflow/"))
        return record.levelno >= 30 or not noisy


def main(argv):
    del argv
    logging.get_absl_handler().addFilter(_QuietLibraries())
    config = _CONFIG.value
    # First, before anything starts a thread (JAX's backends, a gs:// client): threads pick their
    # malloc arena once.
    from bert_jax.training import host_memory
    try:
        memory = host_memory.configure(config.get("keep_freed_host_memory", "auto"))
    except ValueError as e:
        refuse(f"FATAL: {e}")
    logging.info("host memory: %s", memory)
    from bert_jax.workdir import check_paths
    from data_pipeline.storage.paths import StorageError
    try:  # a path no installed backend handles: refused before anything runs or is written
        check_paths(config.to_dict(), _WORKDIR.value)
    except StorageError as e:
        refuse(f"FATAL: {e}")
    # Before anything compiles: programs of earlier runs are loaded instead of compiled again.
    from bert_jax.training import compile_cache
    try:
        logging.info("compilation cache: %s", compile_cache.configure(config.get("compilation_cache", "auto")))
    except ValueError as e:
        refuse(f"FATAL: {e}")
    stats = compile_cache.CacheStats().start()
    init_distributed(_MULTIHOST.value)
    from bert_jax import demo
    from bert_jax.finetune import loop as finetune, predict
    from bert_jax.pretrain import checkpoint_eval, loop as pretrain
    modes = {"pretrain": pretrain.run, "evaluate": checkpoint_eval.evaluate, "demo": demo.run, "finetune": finetune.run,
             "predict": predict.run}
    if config.mode not in modes:
        refuse(f"FATAL: config.mode must be one of {sorted(modes)}, got {config.mode!r}")
    try:
        modes[config.mode](config, _WORKDIR.value)
    except (Exception, SystemExit) as e:  # pylint: disable=broad-except
        if exit_codes.of(e) == exit_codes.CRASH:
            raise  # Python's own traceback and exit code 1: a supervisor retries it
        exit_codes.exit_for(e)  # its own exit code (bert_jax/exit_codes.py): a supervisor does not retry it
    logging.info("compilation cache: %s", stats.summary())


def parse_flags(argv):
    from bert_jax.config_overrides import record_command_line, resolve_config_argv, unknown_overrides
    try:  # `--config=configs/base.py` or `--config=base` from any folder: the installed package's file
        resolved = resolve_config_argv(argv)
    except ValueError as e:
        refuse(f"FATAL: {e}")
    record_command_line(argv)
    unknown = unknown_overrides(argv)
    if unknown:  # before ml_collections' traceback, naming the nearest valid keys
        refuse("FATAL: unknown config key\n" + "\n".join(unknown))
    try:
        return app.parse_flags_with_usage(resolved)
    except SystemExit as e:  # a flag or config file absl refused (its message is printed): a bad config
        raise SystemExit(exit_codes.CONFIG if e.code == 1 else e.code) from None


def refuse(message: str):
    """Ends the process before anything ran: `message` on stderr, exit code `exit_codes.CONFIG`."""
    exit_codes.exit_for(SystemExit(message))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

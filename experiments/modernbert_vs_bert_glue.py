"""Stage 2 of experiments/modernbert_vs_bert.py: both arms' pretrained models fine-tuned on GLUE (issue 72).

    python -m experiments.modernbert_vs_bert --workdir=W --lengths=128 --seconds=360 \\
        [--glue_tasks=sst2,stsb] [--glue_inits=pretrained,random] [--glue_seeds=1,2,3] [--glue_train_rows=3000]

What each arm's pretraining leaves (`modernbert_vs_bert.Arm.save`): two pretraining workdirs of the
arm, `<run>/<arm>/pretrained/` (its train state at the equal-wall-clock mark) and `<run>/<arm>/init/`
(the same model at step 0, before any training: the "no pretraining" arm, drawn as pretraining draws
it), each with the model files and `checkpoints/<step>/state`, as `bert_jax.main --config=configs/tiny.py`
(`configs/modernbert_tiny.py`) leaves its workdir. Each is fine-tuned the way a user would:

- BERT-tiny: `--config.init_checkpoint=<run>/bert/pretrained` (a pretraining workdir, read by
  `bert_jax.convert.load_pretrained`);
- ModernBERT-tiny: `python -m bert_jax.convert --input=<run>/modernbert/pretrained
  --output=<run>/modernbert/pretrained_hf --output_format=hf` (called here as `convert.main`), then
  `--config.model_family=modernbert --config.init_checkpoint=<run>/modernbert/pretrained_hf`;

through `bert_jax.finetune.loop.run` (what `python -m bert_jax.main --config=configs/glue.py` runs,
called in-process; the report records each run's command line) with `config.seeds`: the seeds in one
process (`bert_jax.finetune.restarts`), each seed's last-epoch dev score, their mean and sample std.
Every run has the same settings whatever the arm: the training file (`--glue_train_rows` rows drawn
from the task's train set with a fixed seed; the full dev set is scored), learning rate, epochs,
batch, `max_seq_length`, float32 matmuls (`cpu_bf16=off`), and the pretrained model's dropout (none:
both arms pretrained without it). Tasks: SST-2 (single sentences, accuracy) and STS-B (pairs,
regression, the mean of Pearson and Spearman), the pair task on which experiments/RESULTS.md found
pretraining to matter most for BERT-tiny (MRPC's tiny models sit at the majority class; RTE's 2,490
rows move by ~1 point). The fine-tuning runs of an earlier run of the experiment in the same workdir are
removed first: the pretraining they started from was that run's, not this one's.
"""

from __future__ import annotations

import hashlib
import math
import os
import shlex
import shutil
import time
from typing import Callable

from experiments.pretraining_corpus import DATA, log

FAMILIES = ("bert", "modernbert")  # modernbert_vs_bert.ARMS
INITS = ("pretrained", "random")
SAVED = {"pretrained": "pretrained", "random": "init"}  # the arm's folder for each init
# The parameters a fine-tuning run takes from its init checkpoint (the rest of the task model starts fresh).
ENCODER = {"bert": ("bert",), "modernbert": ("model", "head")}
TASK_NAMES = {"sst2": "SST-2 (accuracy)", "stsb": "STS-B (mean of Pearson and Spearman)",
              "mrpc": "MRPC (mean of F1 and accuracy)", "rte": "RTE (accuracy)", "cola": "CoLA (MCC)"}


def add_flags(p) -> None:
    p.add_argument("--glue_tasks", default="sst2,stsb", help="GLUE tasks fine-tuned after pretraining ('' = none)")
    p.add_argument("--glue_dir", default=os.path.join(DATA, "glue"))
    p.add_argument("--glue_inits", default="pretrained,random",
                   help="pretrained (the equal-wall-clock state) and/or random (the same model at step 0)")
    p.add_argument("--glue_seeds", default="1,2,3")
    p.add_argument("--glue_train_rows", type=int, default=3000, help="training rows per task (0 = all)")
    p.add_argument("--glue_lr", type=float, default=1e-3)
    p.add_argument("--glue_epochs", type=float, default=3.0)
    p.add_argument("--glue_batch", type=int, default=32)
    p.add_argument("--glue_max_seq_length", type=int, default=128)


def check_flags(p, args) -> None:
    """The glue flags parsed in place (lists of tasks, inits and seeds); `p.error` naming a bad one."""
    from data_pipeline.tasks import glue

    args.glue_tasks = [t for t in args.glue_tasks.split(",") if t]
    args.glue_inits = [i for i in args.glue_inits.split(",") if i]
    args.glue_seeds = [int(s) for s in args.glue_seeds.split(",") if s]
    for task in args.glue_tasks:
        if task not in glue.SPECS:
            p.error(f"--glue_tasks: {task!r} is not a GLUE task ({', '.join(sorted(glue.SPECS))})")
    for init in args.glue_inits:
        if init not in INITS:
            p.error(f"--glue_inits: {init!r}, one of {INITS}")
    if args.glue_tasks and not (args.glue_inits and args.glue_seeds):
        p.error("--glue_tasks needs --glue_inits and --glue_seeds")
    if args.glue_tasks and any(length < args.glue_max_seq_length for length in args.lengths):
        p.error(f"--glue_max_seq_length={args.glue_max_seq_length} is past a pretraining length "
                f"({args.lengths}): BERT's position table ends there")
    args.glue_dir = os.path.abspath(args.glue_dir)


# ---------------------------------------------------------------------------------------------
# The arms' checkpoints
# ---------------------------------------------------------------------------------------------


def encoder_digest(params: dict, family: str) -> str:
    """A fingerprint of what a fine-tuning run takes from the checkpoint (`ENCODER[family]`), by
    parameter path: equal parameters, equal digests."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path({k: params[k] for k in ENCODER[family]})[0]
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(np.asarray(leaf, np.float32)).tobytes())
    return h.hexdigest()[:16]


def init_checkpoint(run_dir: str, family: str, init: str) -> tuple[str, list[str]]:
    """(the fine-tuning's `config.init_checkpoint`, the commands that made it) for one arm and init:
    BERT's pretraining workdir as it is; ModernBERT's exported to transformers' format by
    `python -m bert_jax.convert` (into a fresh folder)."""
    workdir = os.path.join(run_dir, family, SAVED[init])
    if family == "bert":
        return workdir, []
    from bert_jax import convert

    out = workdir + "_hf"
    shutil.rmtree(out, ignore_errors=True)
    argv = [f"--input={workdir}", f"--output={out}", "--output_format=hf"]
    if convert.main(argv) != 0:
        raise RuntimeError(f"python -m bert_jax.convert {' '.join(argv)} failed")
    return out, [shlex.join(["python", "-m", "bert_jax.convert", *argv])]


# ---------------------------------------------------------------------------------------------
# Fine-tuning
# ---------------------------------------------------------------------------------------------


def finetune_config(args, task: str, family: str, init: str, train_file: str):
    """configs/glue.py with the settings every run shares; only the family and the init differ."""
    from configs import glue as glue_config

    config = glue_config.get_config()
    config.task = task
    config.data_dir = args.glue_dir
    config.split_files.train = train_file
    config.model_family = family
    config.init_checkpoint = init
    config.seeds = tuple(args.glue_seeds)
    config.max_seq_length = args.glue_max_seq_length
    config.global_batch_size = args.glue_batch
    config.num_train_epochs = args.glue_epochs
    config.learning_rate = args.glue_lr
    config.cpu_bf16 = "off"  # float32 matmuls in both families (ModernBERT has no bf16 path on CPU)
    config.predict_test = False
    config.log_every_steps = 1000
    config.async_checkpointing = False
    if args.quick:
        config.xla_backend_optimization_level = 0  # faster compiles; the model is tiny
        config.packing = False  # every run at one shape: the runs share programs through the cache
        config.trim_padding_buckets = 0
    return config


# The fields of a config that the command line names (the rest are configs/glue.py's defaults).
_FLAGS = ("task", "data_dir", "split_files.train", "model_family", "init_checkpoint", "seeds", "max_seq_length",
          "global_batch_size", "num_train_epochs", "learning_rate", "cpu_bf16", "predict_test",
          "log_every_steps", "async_checkpointing", "xla_backend_optimization_level", "packing",
          "trim_padding_buckets")


def command_line(config, workdir: str) -> str:
    """The `bert_jax.main` command that runs `config` (what this module calls in-process)."""
    from configs import glue as glue_config

    defaults = glue_config.get_config()
    argv = ["python", "-m", "bert_jax.main", "--config=configs/glue.py"]
    for key in _FLAGS:
        value, default = _get(config, key), _get(defaults, key)
        if value != default:
            value = ",".join(map(str, value)) if isinstance(value, tuple) else value
            argv.append(f"--config.{key}={value}")
    return shlex.join(argv + [f"--workdir={workdir}"])


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def finetune(config, run_dir: str, what: str) -> dict:
    """`bert_jax.finetune.loop.run` with `config.seeds` into run_dir: the seeds' last-epoch dev
    scores, their mean and sample std."""
    from bert_jax.finetune import loop
    from experiments.finetuning_arms import score

    started = time.time()
    summary = loop.run(config, run_dir)
    per_seed = {str(s): score(summary["seeds"][str(s)]) for s in config.seeds}
    values = list(per_seed.values())
    mean, std = mean_std(values)
    record = {"scores": per_seed, "mean": mean, "std": std, "init_checkpoint": config.init_checkpoint,
              "train_file": config.split_files.train,
              "command": command_line(config, run_dir), "wall_s": round(time.time() - started, 1),
              "load_average_1min": round(os.getloadavg()[0], 2),  # the machine is shared
              "results": summary["seeds"]}
    log(f"{what}: {' '.join(f'{v:.4f}' for v in values)}; mean {mean:.4f}"
        + (f" ± {std:.4f}" if std is not None else "") + f" ({record['wall_s']} s)")
    return record


def mean_std(values: list) -> tuple:
    """The mean and the sample standard deviation (ddof=1; None for one value)."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else None
    return mean, std


def stage(args, report: dict, progress: Callable[[], None] = lambda: None) -> dict:
    """Every pretraining run of `report` fine-tuned: `{"settings", "runs": {"<length>_<seed>": {task:
    {family: {init: record}}}}}`, also as `report["glue"]` as it grows (`progress()` is called after each
    record: the caller writes what is done). The checkpoints' digests are in the report's runs."""
    from experiments.finetuning_arms import compile_cache, subsample_train

    compile_cache(os.path.join(args.workdir, "xla_cache"))
    out = {"settings": {k: getattr(args, k) for k in vars(args) if k.startswith("glue_")}, "runs": {}}
    report["glue"] = out
    train_files = {t: subsample_train(t, args.glue_dir, os.path.join(args.workdir, "glue_train"), args.glue_train_rows)
                   for t in args.glue_tasks}
    for run in report["runs"]:
        run_dir, key = run["workdir"], f"{run['length']}_{run['seed']}"
        shutil.rmtree(os.path.join(args.workdir, "glue", key), ignore_errors=True)  # an earlier pretraining's
        results = out["runs"].setdefault(key, {})
        inits = {}
        for init in args.glue_inits:  # the pretrained arms first: the comparison the study is for
            for task in args.glue_tasks:
                for family in FAMILIES:
                    if (family, init) not in inits:
                        inits[family, init] = init_checkpoint(run_dir, family, init)
                    path, convert_commands = inits[family, init]
                    config = finetune_config(args, task, family, init=path, train_file=train_files[task])
                    record = finetune(config, os.path.join(args.workdir, "glue", key, f"{family}_{init}", task),
                                      f"length {run['length']} seed {run['seed']} {task} {family} {init}")
                    record["convert_commands"] = convert_commands
                    results.setdefault(task, {}).setdefault(family, {})[init] = record
                    progress()
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def spread(a: dict, b: dict) -> dict:
    """b - a of two records' means, and whether it is within the seeds' spread: the ranges of the
    seeds' scores overlap. `se`: the standard error of the difference (None with one seed)."""
    va, vb = list(a["scores"].values()), list(b["scores"].values())
    overlap = max(min(va), min(vb)) <= min(max(va), max(vb))
    se = (math.sqrt(a["std"] ** 2 / len(va) + b["std"] ** 2 / len(vb))
          if a["std"] is not None and b["std"] is not None else None)
    return {"delta": b["mean"] - a["mean"], "within_seed_spread": overlap, "se": se}


def _pm(record: dict) -> str:
    std = "" if record["std"] is None else f" ± {100 * record['std']:.1f}"
    return f"{100 * record['mean']:.1f}{std}"


def markdown(glue: dict) -> str:
    """RESULTS.md's tables: dev score × 100 per task, arm and init (seeds, mean ± std); then the
    differences ModernBERT − BERT and pretrained − random."""
    lines = ["| pretraining (length, seed) | task | arm | init | dev score × 100, per seed | mean ± std |",
             "|---|---|---|---|---|---|"]
    compare = ["| pretraining (length, seed) | task | difference | Δ (points) | ± se | within the seeds' spread |",
               "|---|---|---|---|---|---|"]
    for key, tasks in glue["runs"].items():
        where = key.replace("_", ", ")
        for task, families in tasks.items():
            for family, inits in families.items():
                for init, r in inits.items():
                    seeds = " ".join(f"{100 * v:.1f}" for v in r["scores"].values())
                    lines.append(f"| {where} | {TASK_NAMES.get(task, task)} | {family} | {init} | {seeds} | {_pm(r)} |")
            pairs = [(f"modernbert − bert, {init}", families["bert"][init], families["modernbert"][init])
                     for init in INITS if all(init in families.get(f, {}) for f in FAMILIES)]
            pairs += [(f"{f}: pretrained − random", families[f]["random"], families[f]["pretrained"])
                      for f in FAMILIES if all(i in families.get(f, {}) for i in INITS)]
            for name, a, b in pairs:
                s = spread(a, b)
                se = "" if s["se"] is None else f"{100 * s['se']:.1f}"
                compare.append(f"| {where} | {task} | {name} | {100 * s['delta']:+.1f} | {se} "
                               f"| {'yes' if s['within_seed_spread'] else 'no'} |")
    return "\n".join(lines + [""] + compare)

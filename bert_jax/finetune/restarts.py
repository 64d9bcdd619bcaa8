"""Random restarts, as the BERT paper ran them: several seeds, the best on dev kept (`config.seeds`).

Section 4.1: "For BERT-Large we found that fine-tuning was sometimes unstable on small datasets,
so we ran several random restarts and selected the best model on the Dev set."

    python -m bert_jax.main --config=configs/glue.py --config.task=rte --config.seeds=1,2,3,4,5 \\
        --config.data_dir=DIR --config.init_checkpoint=PATH --workdir=W

`run_seeds` fine-tunes once per seed in one process, each run the single run of
`bert_jax.finetune.loop.train_seed` with `config.seed` set to that seed, in `W/seeds/<seed>/`
(a whole fine-tuning workdir of its own: checkpoints/, best/, eval_results.json, ...). The runs
share the jitted programs (`preparation.prepare`), so a seed compiles only what no earlier seed needed
(a batch length or packed row count its own plan chooses; none when those are fixed). A seed
whose `eval_results.json` exists is done and not run again; the others resume from their own
checkpoints, so a process killed during seed 2 resumes seed 2 where it stopped.

Then the seed whose best epoch scored highest on the first eval split's primary metric (the
loop's `best_epoch_<metric>`; on a tie the earlier seed of `config.seeds`) becomes the run's model:
its `best/`, `best_predictions/` and top-level files (task.json, the model files, its last epoch's
and test predictions, eval_history.json) are copied to the top of W, where `mode=predict` and
`bert_jax.convert` read a workdir's best model. `W/eval_results.json` is written last: the best
seed's results as a single run writes them, plus `best_seed`, `seeds` (seed -> its results) and,
for every metric K of the results, `K_mean` and `K_std` over the seeds (the sample standard
deviation, ddof=1; null with one seed). Without `config.seeds` nothing here runs.

This module does not import the loop (the loop hands `run_seeds` its `train_seed`).
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Callable, Optional, Sequence

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from bert_jax import layout, workdir as workdir_files
from data_pipeline import storage
from data_pipeline.storage import paths as storage_paths

SEEDS = layout.SEEDS  # W/seeds/<seed>/: one seed's run
# Integers of a run's results that count, not measure: no mean or std.
NOT_METRICS = ("epoch", "step", "best_epoch")
# A seed's files that stay in its folder (its logs); the rest of its top level is copied up.
_OWN_FILES = (layout.TRAIN_LOG,)


def check_seeds(seeds: Sequence) -> tuple[int, ...]:
    """`config.seeds` as a tuple of distinct integers >= 0; ValueError naming the key otherwise."""
    seeds = tuple(seeds)
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"config.seeds={seeds}: {seed!r} is not a seed (integers >= 0, e.g. "
                             "--config.seeds=1,2,3)")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"config.seeds={seeds}: a seed given twice")
    return tuple(int(s) for s in seeds)


def check_workdir(workdir: str, seeds: Sequence) -> None:
    """Refuses (ValueError) a workdir of the other kind: seeds in a single run's workdir (its
    `checkpoints/`), or a single run in a workdir of seeds (its `seeds/`)."""
    if seeds:
        check_seeds(seeds)
        if storage.isdir(storage_paths.join(workdir, layout.CHECKPOINTS)):
            raise ValueError(f"config.seeds={tuple(seeds)}: {workdir} holds a single run "
                             f"({layout.CHECKPOINTS}/); fine-tune the seeds in another workdir")
    elif storage.isdir(storage_paths.join(workdir, SEEDS)):
        raise ValueError(f"{workdir} holds a run of several seeds ({SEEDS}/): give the same config.seeds to "
                         "resume it, or fine-tune a single run in another workdir")


def seed_dir(workdir: str, seed: int) -> str:
    return storage_paths.join(workdir, SEEDS, str(seed))


def finished(workdir: str, seeds: Sequence[int]) -> dict[int, dict]:
    """The results of the seeds whose run finished (its `eval_results.json`), as host 0 sees them:
    every host runs the same seeds."""
    done = np.asarray([storage.isfile(storage_paths.join(seed_dir(workdir, s), layout.EVAL_RESULTS))
                       for s in seeds], np.int32)
    if jax.process_count() > 1:
        done = np.asarray(multihost_utils.broadcast_one_to_all(done))
    return {s: _read_json(storage_paths.join(seed_dir(workdir, s), layout.EVAL_RESULTS))
            for s, d in zip(seeds, done) if d}


def summarize(results: dict[int, dict], metric: str) -> dict:
    """`W/eval_results.json` of a run of several seeds (module docstring) from each seed's results
    (in the order of `config.seeds`); `metric` is the task's primary metric."""
    key = f"best_epoch_{metric}"
    scores = {s: r[key] for s, r in results.items() if _number(r.get(key))}
    best = max(scores, key=scores.get) if scores else None  # max keeps the first of equals
    summary = dict(results[best]) if best is not None else {}
    summary["best_seed"] = best
    summary[SEEDS] = {str(s): r for s, r in results.items()}
    first = next(iter(results.values()))
    for k in first:
        values = [r.get(k) for r in results.values()]
        if k in NOT_METRICS or not all(_number(v) for v in values):
            continue
        values = np.asarray(values, np.float64)
        summary[f"{k}_mean"] = float(np.mean(values))
        summary[f"{k}_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else None
    return summary


def _read_json(path: str):
    return json.loads(storage.read_text(path))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def publish(workdir: str, summary: dict) -> None:
    """The best seed's model and files at the top of `workdir`, then `eval_results.json` (written
    last: a copy cut short is redone by the next run). Nothing when that file already says it."""
    results_file = storage_paths.join(workdir, layout.EVAL_RESULTS)
    if storage.isfile(results_file) and _read_json(results_file) == json.loads(json.dumps(summary)):
        return
    storage.remove(results_file, missing_ok=True)
    best = summary["best_seed"]
    if best is not None:
        source = seed_dir(workdir, best)
        for folder in (layout.BEST, layout.BEST_PREDICTIONS, layout.TRANSFORMERS):
            storage.rmtree(storage_paths.join(workdir, folder))
            if storage.isdir(storage_paths.join(source, folder)):
                storage.copy_tree(storage_paths.join(source, folder), storage_paths.join(workdir, folder))
        for rel, info in storage.files_info(source).items():
            if "/" not in rel and rel not in _OWN_FILES and not rel.startswith(layout.EVENTS_PREFIX):
                storage.copy(info["path"], storage_paths.join(workdir, rel))
    workdir_files.write_json(workdir, layout.EVAL_RESULTS, summary, indent=2, sort_keys=True)


def run_seeds(config: ml_collections.ConfigDict, workdir: str, seeds: Sequence[int], metric: str,
              train: Callable[[ml_collections.ConfigDict, str], tuple[dict, bool]]) -> dict:
    """Runs `train(config with seed=s, W/seeds/<s>)` -> (results, finished) for each seed not done
    yet, then keeps the best (module docstring). Returns the summary; a run stopped by SIGTERM or
    preemption returns its seed's results so far and publishes nothing (the rerun resumes it)."""
    seeds = check_seeds(seeds)
    results = finished(workdir, seeds)
    if results:
        logging.info("seeds %s finished earlier (%s/<seed>/%s): not run again", sorted(results), SEEDS,
                     layout.EVAL_RESULTS)
    for n, seed in enumerate(seeds):
        if seed in results:
            continue
        logging.info("seed %d (%d of %d) in %s", seed, n + 1, len(seeds), seed_dir(workdir, seed))
        seed_config = copy.deepcopy(config)
        seed_config.seed = seed
        seed_config.seeds = ()
        out, done = train(seed_config, seed_dir(workdir, seed))
        if not done:
            logging.warning("seed %d stopped (SIGTERM/preemption): its checkpoint resumes it on the next run", seed)
            return out
        results[seed] = out
        logging.info("seed %d: %s %s (best epoch %s)", seed, metric, out.get(f"best_epoch_{metric}"),
                     out.get("best_epoch"))
    summary = summarize({s: results[s] for s in seeds}, metric)
    logging.info("%s", describe(summary, metric))
    if jax.process_index() == 0:
        publish(workdir, summary)
        print(json.dumps(summary, sort_keys=True))
    return summary


def describe(summary: dict, metric: str) -> str:
    """One log line: every seed's score, their mean and std, the best seed."""
    key = f"best_epoch_{metric}"
    per_seed = ", ".join(f"seed {s}: {r.get(key)}" for s, r in summary[SEEDS].items())
    mean, std = summary.get(f"{key}_mean"), summary.get(f"{key}_std")
    spread = "" if mean is None else (f"; mean {mean:.6g}" + ("" if std is None else f" ± {std:.6g} (sample std)")
                                      + f" over {len(summary[SEEDS])} seeds")
    kept = (f"; best: seed {summary['best_seed']}, its best epoch in {layout.BEST}/"
            if summary["best_seed"] is not None else f"; no seed has a {metric}: no {layout.BEST}/")
    return f"{key} of each seed's best epoch: {per_seed}{spread}{kept}"


def best_seed_of(workdir: str) -> Optional[int]:
    """The best seed of a run of several seeds in `workdir` (its `eval_results.json`), else None."""
    path = storage_paths.join(workdir, layout.EVAL_RESULTS)
    if not storage.isfile(path):
        return None
    return _read_json(path).get("best_seed")

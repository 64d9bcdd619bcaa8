"""The pretraining loop: mesh, sharded init, restore, jit(step), loop, eval, saves.

`run(config, workdir)` pretrains (`mode=pretrain`; `mode=evaluate`, a checkpoint scored on pretraining
TFRecords, is `checkpoint_eval.py`). It reads the ml_collections config here and passes explicit
arguments below.

The loop, in order of what can go wrong:
- every host checks, before compiling, that all hosts resolved the same config (a mismatch exits
  all of them), that the batch and the model divide over the mesh, and that the data, the
  vocabulary and the model agree (startup_checks.py);
- the state is initialized directly into its shards, or restored from the newest committed
  checkpoint in `workdir/checkpoints` (params, optimizer state, RNG, step) together with each host's
  input-pipeline position, so a resumed run sees exactly the batches it would have seen
  (feed.py);
- the data manifest (`dataset_info.json`) is verified before the first step;
- a non-finite loss or gradient never touches the parameters; `nonfinite="stop"` ends the run with
  a diagnostic, `"skip"` goes on until `max_consecutive_nonfinite` bad steps in a row;
- a loss spike (`divergence.py`: `divergence_steps` spike steps in a row) stops the run
  (`on_divergence="stop"`) or rolls it back to a checkpoint before the spike and skips the batches
  around it (`"rollback"`: rollback.py); batches to skip after a step (`skip_batches`, and the
  rollbacks' record in `skipped_batches.json`) are read and discarded once the loop is at that step;
- SIGTERM (or the multi-host preemption sync point) saves a checkpoint and exits cleanly; a failed
  save stops the run with an error within one save interval.

Everything before the first step (the checks, the mesh, the restore and its version check, the
first phase's input) runs inside `exit_codes.refusals()`: a bad config ends the process with exit
code 78 (`bert_jax/exit_codes.py`), which a supervisor does not retry; a non-finite loss under
"stop" ends it with 80 (`NonFiniteLossError`), a divergence that stops it with 81.

Two-phase pretraining (the paper's 90% of steps at length 128, 10% at 512) runs one optimizer
and one learning-rate schedule over all steps (a phase may set its own rate in it: phases.py);
each phase has its own data and compiled step.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Optional

import flax.linen as nn
import jax
import ml_collections

from bert_jax import exit_codes, layout, versions
from bert_jax.checkpoints import checkpointer, step_dirs
from bert_jax.model import layers
from bert_jax.model.model_config import BertConfig
from bert_jax.pretrain import divergence, model_family, rollback, startup_checks, steps
from bert_jax.pretrain.feed import make_eval_input, make_train_input, run_eval
from bert_jax.pretrain.phases import rate_changes, resolve_phases
from bert_jax.training import optim, run_setup, sharding, train_state
from bert_jax.workdir import metric_writer, write_model_files
from data_pipeline.storage import paths as storage_paths


def blocks_every_step(backend: str, process_count: int) -> bool:
    """Whether the loop waits for each step's result before dispatching the next.

    Only for several processes on CPU: there, gloo's collectives of consecutive steps interleave
    differently on each process and deadlocked within ~50 steps (RELIABILITY.md). On TPU and GPU
    the host dispatches ahead, so that input and logging overlap the device's step: waiting costs
    4-6% of BERT-Large's step on an H100 and an H200 (benchmarks/step/RESULTS.md, waited-for against
    pipelined steps, 2026-11-27 and 2026-11-28).
    """
    return backend == "cpu" and process_count > 1


# ---------------------------------------------------------------------------------------------
# Model, optimizer, state
# ---------------------------------------------------------------------------------------------


def build(config: ml_collections.ConfigDict, bert_config: BertConfig, mesh):
    """Model, optimizer, schedule and a sharded-init function for the train state (of either family)."""
    model = model_family.pretraining_model(bert_config)
    schedule = optim.learning_rate_schedule(
        config.learning_rate, config.warmup_steps, config.num_train_steps,
        power=config.lr_decay_power, google_style=config.google_lr_schedule,
        decay_steps=config.get("lr_decay_steps"), decay_shape=config.get("lr_decay_shape", "polynomial"),
        rate_changes=rate_changes(config))
    tx = optim.make_optimizer(config.optimizer, schedule, weight_decay=config.weight_decay,
                              b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                              clip_norm=config.clip_norm or None)

    def init_state(rng):
        params_rng, dropout_rng = jax.random.split(rng)
        variables = model.init(params_rng, **model_family.dummy_inputs(bert_config))
        return train_state.create_train_state(variables["params"], tx, dropout_rng,
                                        fp8=variables.get(layers.FP8_COLLECTION))

    return model, tx, schedule, init_state


# ---------------------------------------------------------------------------------------------
# Pretraining
# ---------------------------------------------------------------------------------------------


class NonFiniteLossError(FloatingPointError):
    """A non-finite loss or gradient under `nonfinite="stop"`, or too many in a row (exit code 80)."""


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Pretrains per `config`, resuming from `workdir` when it holds a checkpoint.

    Returns the last logged metrics (also written to TensorBoard under `workdir`).
    """
    jax.config.update("jax_threefry_partitionable", True)
    # A bad config, data, path or checkpoint before the first step: not retried (a path that matches
    # nothing raises FileNotFoundError, which another attempt would meet again).
    with exit_codes.refusals(types=(ValueError, TypeError, KeyError, FileNotFoundError)):
        pretraining = _Pretraining(config, workdir)
    return pretraining.train()


class _Window:
    """The steps since the last log line: their metrics (fetched from the devices once needed), how
    many of them were screened (`_Pretraining._screen`), and the host's time spent on input."""

    def __init__(self, step: int):
        self.first_step = step + 1
        self.metrics: list = []
        self.screened = 0
        self.started, self.input_seconds = time.time(), 0.0

    def fetched(self) -> list:
        self.metrics = jax.device_get(self.metrics)  # the fetched ones again: no device transfer
        return self.metrics


class _Pretraining:
    """One pretraining run: built (checked, restored) by the constructor, then `train()`ed once."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        self.config, self.workdir = config, workdir
        run_setup.use_prng_impl(config)
        startup_checks.check_same_config_on_all_hosts(config)
        self.bert_config = bert_config = run_setup.model_config_from(config, workdir=workdir)
        model_family.check(config, bert_config)
        self.phases = resolve_phases(config)
        startup_checks.check_sequence_lengths(config, bert_config, self.phases)
        self.mesh = sharding.create_mesh(config.mesh.to_dict(), config.dcn_mesh.to_dict())
        startup_checks.check_mesh(config, bert_config, self.mesh)
        if config.objective not in ("mlm", "ltr"):
            raise ValueError(f"config.objective must be 'mlm' or 'ltr', got {config.objective!r}")
        if config.nonfinite not in ("stop", "skip"):
            raise ValueError(f"config.nonfinite must be 'stop' or 'skip', got {config.nonfinite!r}")
        self.divergence = divergence.settings_from(config)
        self.skipped = rollback.SkippedBatches(workdir, divergence.parse_skip_batches(config.get("skip_batches", "")))
        self.special_ids = startup_checks.check_vocabulary(
            config, bert_config.vocab_size, [p.train_data for p in self.phases]
            + ([config.eval_data] if config.eval_data else []))
        model_family.check_special_token_ids(bert_config, self.special_ids, startup_checks.vocabulary_key(config))
        if config.eval_data and config.eval_every_steps:
            make_eval_input(config, config.eval_data, workdir)  # bad eval data: an error now, not after hours
        if jax.process_index() == 0:
            write_model_files(workdir, bert_config, config.vocab_file, startup_checks.data_casing(self.phases),
                              tokenizer_json=config.get("tokenizer_json", ""))

        self.model, self.tx, self.schedule, init_state = build(config, bert_config, self.mesh)
        abstract = jax.eval_shape(init_state, jax.random.key(config.seed))
        self.state_shardings = sharding.logical_to_sharding(abstract, self.mesh, sharding.DEFAULT_RULES)
        self.abstract_state = sharding.abstract_with_shardings(nn.meta.unbox(abstract), self.state_shardings)
        self.installed_versions = versions.installed()  # saved with every step, checked on resume (versions.py)
        self.ckpt = checkpointer.Checkpointer(
            storage_paths.join(workdir, layout.CHECKPOINTS), save_interval_steps=config.checkpoint_every_steps,
            max_to_keep=config.keep_checkpoints, async_save=config.async_checkpointing,
            on_damaged=config.get("on_damaged_checkpoint", "fallback"),
            save_timeout_s=config.get("checkpoint_save_timeout_seconds", 1800),
            restore_timeout_s=config.get("checkpoint_restore_timeout_seconds", 1800))
        try:
            self._start(init_state)
        except BaseException:
            self.ckpt.close()  # puts the previous SIGTERM handler back
            raise

    def _start(self, init_state) -> None:
        """The state (restored, or initialized into its shards), the monitor, and the first phase's input."""
        config, ckpt = self.config, self.ckpt
        self.meta: dict = {}
        if ckpt.latest_step() is not None:  # the newest intact step: damaged ones are skipped (checkpointer.py)
            start_step, self.state, self.meta = ckpt.restore_latest(self.abstract_state)
            # Before anything compiles.
            versions.check_resume(self.meta.get(versions.META_KEY),
                                  allow_change=config.get("allow_version_change", False),
                                  where=f"checkpoint step {start_step} in {ckpt.directory}")
            logging.info("resumed from step %d", start_step)
            self.step = int(start_step)
            startup_checks.report_schedule_change(config, self.meta, self.step)
        else:
            self.state, _ = sharding.sharded_init(init_state, jax.random.key(config.seed), self.mesh,
                                                  sharding.DEFAULT_RULES)
            self.step = 0
            if config.init_checkpoint:  # continued pretraining from released (or our) weights
                self.state = self.state.replace(params=model_family.init_params(
                    config, self.bert_config, self.state.params, self.state_shardings.params,
                    google_gelu=config.get("google_gelu")))
                logging.info("initialized from %s", config.init_checkpoint)
        self.monitor = self._monitor()
        # Before compiling: a position that cannot carry over is refused here.
        self.batches = next((self._phase_input(i) for i, p in enumerate(self.phases) if self.step < p.end_step), None)

    def _monitor(self) -> Optional[divergence.DivergenceMonitor]:
        """The divergence monitor, with the state saved in the checkpoint the run is at (`self.meta`)."""
        if self.divergence is None:
            return None
        saved = self.meta.get(divergence.META_KEY)
        if saved is not None and saved.get("last_step") != self.step:  # not this step's: not to be trusted
            saved = None
        if saved is None and self.step > 0:
            logging.info("checkpoint step %d has no divergence statistic of its own: it warms up again "
                         "(config.divergence_warmup_steps=%d)", self.step, self.divergence.warmup_steps)
        return divergence.DivergenceMonitor(self.divergence, saved, self.step)

    def _phase_input(self, phase_index: int):
        """Phase `phase_index`'s input at the run's step: from the checkpoint's position inside the phase."""
        phase = self.phases[phase_index]
        batches = make_train_input(self.config, phase, self.special_ids, self.workdir)
        if self.step > phase.start_step:
            if self.meta.get("phase") != phase_index:
                raise step_dirs.CheckpointRestoreError(
                    f"checkpoint step {self.step} belongs to phase {self.meta.get('phase')}, expected {phase_index}")
            batches.restore_shards(input_position(self.config, self.ckpt, self.step, self.meta))
        return batches

    # --- the loop -------------------------------------------------------------------------------

    def train(self) -> dict:
        """Trains every phase from the run's step; returns the last logged metrics."""
        config = self.config
        self.writer = metric_writer(self.workdir, just_logging=jax.process_index() > 0)
        self.log_path = storage_paths.join(self.workdir, layout.TRAIN_LOG)
        self.last_metrics: dict = {}
        self.consecutive_bad = 0
        try:
            if self.step == 0:
                self.writer.write_hparams(run_setup.hparams(config, self.bert_config))
            batch_sharding = sharding.batch_sharding(self.mesh)
            train_step = functools.partial(steps.train_step, model=self.model, tx=self.tx, schedule=self.schedule,
                                           accum_steps=config.grad_accum_steps, use_nsp=config.use_nsp,
                                           objective=config.objective, mesh=self.mesh)
            self.p_train = jax.jit(train_step, in_shardings=(self.state_shardings, batch_sharding),
                                   out_shardings=(self.state_shardings, None), donate_argnums=0)
            # Evaluation runs the weights in the compute dtype: FP8 is how the training step multiplies.
            eval_model = model_family.eval_model(self.bert_config)
            self.p_eval = jax.jit(functools.partial(steps.eval_step, model=eval_model, objective=config.objective),
                                  in_shardings=(self.state_shardings.params, batch_sharding))
            self.peak = run_setup.peak_flops_per_device()
            self.block_every_step = blocks_every_step(jax.default_backend(), jax.process_count())
            with jax.set_mesh(self.mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
                for phase_index, phase in enumerate(self.phases):
                    if self.step >= phase.end_step:
                        continue
                    if self.batches is None:
                        self.batches = self._phase_input(phase_index)
                    stopped = self._train_phase(phase_index, phase)
                    self.batches = None
                    if stopped:
                        break
        finally:
            try:
                self.writer.close()  # a gs:// workdir's events are uploaded here at the latest
            finally:
                self.ckpt.close()  # waits for the last save; raises if it failed
        return self.last_metrics

    def _train_phase(self, phase_index: int, phase) -> bool:
        """Trains `phase` to its end; True when the run stopped (SIGTERM, preemption) inside it."""
        config, ckpt = self.config, self.ckpt
        flops = model_family.train_flops_per_sequence(self.bert_config, phase.max_seq_length,
                                                      phase.max_predictions_per_seq)
        phase_step = None  # the phase's compiled step (`compile_step`), at its first batch
        window = _Window(self.step)
        from tqdm import tqdm
        bar = tqdm(total=phase.end_step - phase.start_step, initial=self.step - phase.start_step,
                   desc=f"phase {phase_index + 1}/{len(self.phases)} (length {phase.max_seq_length})",
                   disable=jax.process_index() > 0, dynamic_ncols=True)
        while self.step < phase.end_step:
            self._skip_batches()
            # Time the host waits for input: the device runs the previous (dispatched) step
            # meanwhile, so input stalls the loop only when this exceeds a step.
            input_started = time.perf_counter()
            batch = next(self.batches)
            startup_checks.check_token_ids(batch, self.bert_config.vocab_size, phase.train_data)
            global_batch = sharding.to_global(batch, self.mesh)
            window.input_seconds += time.perf_counter() - input_started
            if phase_step is None:
                phase_step = compile_step(self.p_train, self.state, global_batch, f"phase{phase_index}_step{self.step}")
            # Nothing may reach the step implicitly from the host (a numpy leak would be copied
            # every step, and is wrong multi-host).
            with jax.transfer_guard_host_to_device("disallow"):
                self.state, metrics = phase_step(self.state, global_batch)
            self.step += 1
            if self.block_every_step:
                jax.block_until_ready(metrics)
            window.metrics.append(metrics)
            bar.update(1)
            step = self.step
            log_now = step % config.log_every_steps == 0 or step == phase.end_step
            stop = ckpt.should_stop(step)
            save_now = stop or step == phase.end_step or step % config.checkpoint_every_steps == 0
            # The monitor's state saved with a step covers exactly the steps up to it: they are
            # fetched and judged before the save (without it, only when logged).
            found = self._screen(window) if log_now or (save_now and self.monitor is not None) else None
            if log_now or found is not None:
                self.last_metrics = self._log(window, flops, phase, bar)
                window = _Window(step)
            if found is not None:
                self._diverged(found, phase_index, phase)
                window = _Window(self.step)
                bar.n = self.step - phase.start_step
                bar.refresh()
                continue
            if save_now:
                # The log lines so far land before the step is saved (bounded: 10 s), so a run
                # killed after the save and resumed past it has them all.
                self.writer.flush()
            # Saved before evaluating: an evaluation that fails loses no training.
            meta = {"phase": phase_index, "step": step, "data_shards": self.batches.num_shards,
                    "schedule": {k: config.get(k) for k in startup_checks.SCHEDULE_KEYS},
                    versions.META_KEY: self.installed_versions}
            if self.monitor is not None:
                meta[divergence.META_KEY] = self.monitor.state()
            ckpt.save(step, self.state, meta, force=stop or step == phase.end_step,
                      input_state_writer=self.batches.save_state)
            if stop:
                logging.warning("preemption/SIGTERM: saved step %d, exiting", step)
                bar.close()
                return True
            if config.eval_data and config.eval_every_steps and step % config.eval_every_steps == 0:
                evaluation = run_eval(self.p_eval, self.state.params,
                                      make_eval_input(config, config.eval_data, self.workdir), self.mesh,
                                      config.eval_steps)
                self.writer.write_scalars(step, {f"eval/{k}": v for k, v in evaluation.items()})
        bar.close()
        return False

    def _skip_batches(self) -> None:
        """Reads and discards the batches to skip once the run is at this step (rollback.py)."""
        count = self.skipped.after(self.step)
        if count:
            logging.warning("skipping %d batches after step %d (%d by config.skip_batches, %d recorded in %s)",
                            count, self.step, self.skipped.by_hand.get(self.step, 0),
                            self.skipped.recorded.get(self.step, 0), self.skipped.path)
            for _ in range(count):
                next(self.batches)

    def _screen(self, window: _Window) -> Optional[divergence.Divergence]:
        """Judges the window's steps not judged yet, in step order: finiteness (`config.nonfinite`),
        then the divergence monitor. Returns the first divergence found (later steps unjudged).

        Raises:
            NonFiniteLossError: a non-finite step under nonfinite="stop", or too many in a row.
        """
        config = self.config
        fetched = window.fetched()
        for i in range(window.screened, len(fetched)):
            m, step = fetched[i], window.first_step + i
            finite = float(m["finite"]) != 0.0
            window.screened = i + 1
            if not finite:
                self.consecutive_bad += 1
                where = (f"step {step}: non-finite loss or gradient (loss={float(m['loss'])}, "
                         f"grad_norm={float(m['grad_norm'])}, mlm_loss_sum={float(m['mlm_loss_sum'])}, "
                         f"nsp_loss_sum={float(m['nsp_loss_sum'])}); the update was not applied")
                if config.nonfinite == "stop":
                    raise NonFiniteLossError(where + "; set config.nonfinite='skip' to go on past such steps")
                logging.warning("%s (%d in a row)", where, self.consecutive_bad)
                if self.consecutive_bad >= config.max_consecutive_nonfinite:
                    raise NonFiniteLossError(
                        f"{self.consecutive_bad} consecutive non-finite steps up to step {step} "
                        f"(config.max_consecutive_nonfinite={config.max_consecutive_nonfinite})")
            else:
                self.consecutive_bad = 0
            if self.monitor is not None:
                found = self.monitor.observe(step, float(m["loss"]), finite)
                if found is not None:
                    return found
        return None

    def _diverged(self, found: divergence.Divergence, phase_index: int, phase) -> None:
        """Stops the run (`DivergenceError`), or rolls it back to a checkpoint before the spike
        (rollback.py) and rebuilds the phase's input at that checkpoint's position."""
        if self.divergence.action == "stop":
            raise divergence.DivergenceError(
                f"{found.describe()} (config.on_divergence='stop'). To go on: resume with "
                "config.on_divergence='rollback', or skip the batches by hand (config.skip_batches='C:S': after "
                "checkpoint step C, S batches)")
        self.step, self.state, self.meta = rollback.roll_back(
            found, self.divergence, self.ckpt, self.abstract_state, self.skipped, phase.start_step, self.writer,
            self.log_path)
        self.monitor = self._monitor()
        self.consecutive_bad = 0
        self.batches = self._phase_input(phase_index)  # as a resume does; the skip applies at the loop's top

    def _log(self, window: _Window, flops: float, phase, bar) -> dict:
        """Writes the window's per-step jsonl lines (process 0) and its scalars; returns them.

        `window.input_seconds`: the window's host time in `next(batches)` + `to_global`, logged per
        step (`input_ms_per_step`) and as a share of the window (`input_fraction`; near 0 when the
        input pipeline keeps ahead of the device)."""
        config = self.config
        fetched = window.fetched()
        seconds = time.time() - window.started  # after the fetch: steps dispatch asynchronously
        first_step, step = window.first_step, window.first_step + len(fetched) - 1
        if jax.process_index() == 0:
            self.writer.append_jsonl(self.log_path, ({"step": first_step + i, "loss": float(m["loss"]),
                                                      "grad_norm": float(m["grad_norm"])}
                                                     for i, m in enumerate(fetched)))
        sums = {k: sum(float(m[k]) for m in fetched) for k in fetched[-1]}
        n = len(fetched)
        seqs_per_s = n * config.global_batch_size / max(seconds, 1e-9)
        out = {
            "loss": sums["loss"] / n,
            "mlm_loss": sums["mlm_loss_sum"] / max(sums["mlm_weight"], 1e-9),
            "mlm_accuracy": sums["mlm_correct"] / max(sums["mlm_weight"], 1e-9),
            "nsp_loss": sums["nsp_loss_sum"] / max(sums["nsp_weight"], 1e-9),
            "nsp_accuracy": sums["nsp_correct"] / max(sums["nsp_weight"], 1e-9),
            "grad_norm": float(fetched[-1]["grad_norm"]),
            "learning_rate": float(fetched[-1]["learning_rate"]),
            "sequences_per_second": seqs_per_s,
            "tokens_per_second": seqs_per_s * phase.max_seq_length,
            "input_ms_per_step": 1e3 * window.input_seconds / n,
            "input_fraction": window.input_seconds / max(seconds, 1e-9),
        }
        if self.peak:
            out["mfu"] = seqs_per_s * flops / (self.peak * jax.device_count())
        self.writer.write_scalars(step, {f"train/{k}": v for k, v in out.items()})
        bar.set_postfix(loss=f"{out['loss']:.3f}", mlm_acc=f"{out['mlm_accuracy']:.3f}", refresh=False)
        return out


def input_position(config: ml_collections.ConfigDict, ckpt, step: int, meta: dict):
    """Where each file shard's saved input position is, for a resume of `step`: a function of the
    shard's global index (`ShardedInput.restore_shards`).

    The position is saved per shard (`input_state/<step>/process_<i>/shard_<j>`); the same shards
    read by another number of processes are found in the folders of the processes that saved
    them, so a run resumes on more or fewer hosts with the batches it would have read. With
    another number of shards (`config.data_shards` unset, so one per process) the files split
    differently, and the run is refused here, before anything compiles, with the setting that
    would resume it.
    """
    saved_processes = ckpt.input_state_process_count(step) or jax.process_count()
    shards = config.data_shards or jax.process_count()
    saved_shards = meta.get("data_shards")
    if saved_shards is None:  # saved before checkpoints recorded their shard count
        if saved_processes != jax.process_count():
            raise step_dirs.CheckpointRestoreError(
                f"checkpoint step {step} was saved by {saved_processes} processes without its file shard count "
                f"(an older bert_jax): resume it on {saved_processes} processes")
        saved_shards = shards
    if saved_shards != shards:
        fix = (f"set config.data_shards={saved_shards}" if saved_shards % jax.process_count() == 0 else
               f"resume on a number of processes that divides {saved_shards}")
        raise step_dirs.CheckpointRestoreError(
            f"checkpoint step {step} was saved by {saved_processes} processes reading {saved_shards} file shards; "
            f"this run has {jax.process_count()} processes and {shards} shards (config.data_shards="
            f"{config.data_shards}), which split the files differently, so the input position cannot carry over: "
            f"{fix} to resume it (the batches then are the ones the saved run would have read)")
    per_saved_process = saved_shards // saved_processes
    return lambda shard: storage_paths.join(ckpt.input_state_dir(step, shard // per_saved_process),
                                      f"shard_{shard % per_saved_process}")


def compile_step(p_train, state, batch, name: str):
    """The jitted step compiled for this phase's shapes, ahead of its first call.

    With several processes, every host then waits at a barrier of jax's coordination service
    (not a collective) until all have compiled, so the step's first collectives start together:
    on CPU, gloo gives a peer 30 s to join a new communicator, which a host still compiling, or
    slowed by a loaded machine, missed.
    """
    compiled = p_train.lower(state, batch).compile()
    if jax.process_count() > 1:
        import orbax.checkpoint as ocp
        ocp.multihost.sync_global_processes(f"bert_jax_compiled_{name}", timeout=3600,
                                            processes=set(range(jax.process_count())))
    return compiled

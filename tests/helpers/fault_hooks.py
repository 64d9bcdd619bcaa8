"""Fault hooks the storage and pretraining tests install as a run's `sitecustomize` (source text, run at start-up)."""

# The bucket stops answering (the emulator, $BERT_JAX_TEST_EMULATOR_PID, SIGSTOPped) as this process
# starts saving step $FAULT_FREEZE_AT_SAVE.
FREEZE_AT_SAVE = r"""
import os
_freeze_step = os.environ.get("FAULT_FREEZE_AT_SAVE")
if _freeze_step:
    import signal
    import orbax.checkpoint as ocp
    _save_unfrozen = ocp.CheckpointManager.save

    def _frozen_save(self, step, *args, **kwargs):
        if step == int(_freeze_step):
            os.kill(int(os.environ["BERT_JAX_TEST_EMULATOR_PID"]), signal.SIGSTOP)
        return _save_unfrozen(self, step, *args, **kwargs)

    ocp.CheckpointManager.save = _frozen_save
"""

# The run holds still once it has logged a step of $FAULT_PAUSE_AT_STEPS (comma-separated), until
# the test lets it go: it creates `paused-<step>` in $FAULT_PAUSE_DIR, then waits (at most 300 s)
# for `resume-<step>` there; a step whose `resume-<step>` exists already does not stop it (a run
# resumed past it). A test that signals a worker "once step N is logged" then finds the run at N,
# however fast the machine (the run's own log reaches the bucket seconds later, by then finished).
PAUSE_AT_STEP = r"""
import os
_pause_steps = {int(s) for s in os.environ.get("FAULT_PAUSE_AT_STEPS", "").split(",") if s}
if _pause_steps:
    import time
    from absl import logging as _absl_logging
    _log_info = _absl_logging.info

    def _info_then_pause(msg, *args, **kwargs):
        _log_info(msg, *args, **kwargs)
        if msg == "[%d] %s" and args and args[0] in _pause_steps:  # MetricWriter.write_scalars' line
            where = os.environ["FAULT_PAUSE_DIR"]
            resume = os.path.join(where, f"resume-{args[0]}")
            if not os.path.exists(resume):
                open(os.path.join(where, f"paused-{args[0]}"), "w").close()
                deadline = time.time() + 300
                while not os.path.exists(resume) and time.time() < deadline:
                    time.sleep(0.05)

    _absl_logging.info = _info_then_pause
"""

# The loss the divergence statistic is fed (`bert_jax.pretrain.divergence.DivergenceMonitor.observe`)
# is 100 times larger at the steps of $FAULT_SPIKE_STEPS (comma-separated; several spikes separated by
# ";", e.g. "5,6;25,26"): planted loss spikes. Each once per process tree: after the last step of a
# spike was fed, it creates `spiked-<worker>[-<i>]` in $FAULT_SPIKE_DIR (<worker>: $TPU_WORKER_ID, or
# 0; -<i> for the i-th spike past the first), and that spike does nothing while the file exists, so
# the same steps train normally after the rollback (and in a resumed run). The parameters and
# train_log.jsonl's losses stay the real ones: only the judgement sees the spike.
SPIKE_AT_STEPS = r"""
import os
_spikes = [{int(s) for s in w.split(",") if s} for w in os.environ.get("FAULT_SPIKE_STEPS", "").split(";")]
_spikes = [w for w in _spikes if w]
if _spikes:
    from bert_jax.pretrain import divergence as _divergence
    _observe_unspiked = _divergence.DivergenceMonitor.observe
    _worker = os.environ.get("TPU_WORKER_ID", "0")
    _spiked = [os.path.join(os.environ["FAULT_SPIKE_DIR"], f"spiked-{_worker}" + (f"-{i}" if i else ""))
               for i in range(len(_spikes))]

    def _observe_spiked(self, step, loss, finite):
        spike = next((i for i, w in enumerate(_spikes) if step in w and not os.path.exists(_spiked[i])), None)
        if spike is None:
            return _observe_unspiked(self, step, loss, finite)
        found = _observe_unspiked(self, step, loss * 100.0, finite)
        if step == max(_spikes[spike]):
            open(_spiked[spike], "w").close()
        return found

    _divergence.DivergenceMonitor.observe = _observe_spiked
"""

# The run kills itself (SIGKILL) once it has logged $FAULT_KILL_AFTER_ROLLBACK windows of steps after
# writing a rollback event line to train_log.jsonl, its log lines flushed first (so a test can read the
# steps trained after the rollback). A resumed run that makes no rollback is left alone.
KILL_AFTER_ROLLBACK = r"""
import os
_kill_after = int(os.environ.get("FAULT_KILL_AFTER_ROLLBACK", "0"))
if _kill_after:
    import signal
    from bert_jax import workdir as _workdir
    _append_unwatched = _workdir.MetricWriter.append_jsonl
    _scalars_unwatched = _workdir.MetricWriter.write_scalars
    _since_rollback = []

    def _append_watched(self, path, rows):
        rows = list(rows)
        if any(row.get("event") == "rollback" for row in rows):
            _since_rollback.append(0)
        return _append_unwatched(self, path, rows)

    def _scalars_watched(self, step, scalars):
        _scalars_unwatched(self, step, scalars)
        if _since_rollback:
            _since_rollback[-1] += 1
            if _since_rollback[-1] >= _kill_after:
                self.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    _workdir.MetricWriter.append_jsonl = _append_watched
    _workdir.MetricWriter.write_scalars = _scalars_watched
"""

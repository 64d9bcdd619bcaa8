"""Fault hooks the storage tests install as a run's `sitecustomize` (source text, run at start-up)."""

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

"""`Checkpointer.move_steps_aside`: the steps saved after a loss spike leave the directory for
`diverged/` (kept, with their input state), a resume then sees the step before, and a step saved
later under a moved step's number is a new step, verified afresh."""

import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.checkpoints.step_dirs import CheckpointCorruptError
from bert_jax.checkpoints.checkpointer import Checkpointer


def _save(ckpt, step, value):
    ckpt.save(step, {"w": jnp.full(4, float(value))}, {"position": value},
              input_state_writer=lambda path: open(f"{path}/position", "w").write(str(value)))
    ckpt.wait_until_finished()


def test_steps_after_the_spike_move_to_diverged_and_their_numbers_are_saved_afresh(tmp_path):
    ckpt = Checkpointer(tmp_path, save_interval_steps=1, max_to_keep=5, handle_sigterm=False)
    target = {"w": jnp.zeros(4)}
    for step in (2, 4, 6):
        _save(ckpt, step, step)
    assert ckpt.restore(target, step=4)[1] == {"position": 4}  # step 4 verified (and its verdict kept)

    assert ckpt.move_steps_aside(3) == [4, 6]
    assert ckpt.all_steps() == [2] and ckpt.latest_step() == 2
    moved = sorted(p.name for p in (tmp_path / "diverged").iterdir())
    assert [name.split("-")[0] for name in moved] == ["4", "6"]
    for name in moved:  # kept whole: the step, its manifest and its input state
        step = name.split("-")[0]
        assert (tmp_path / "diverged" / name / step / "bert_jax_integrity.json").is_file()
        assert (tmp_path / "diverged" / name / "input_state" / "process_0" / "position").read_text() == step
    assert not (tmp_path / "4").exists() and not (tmp_path / "input_state" / "4").exists()
    step, state, meta = ckpt.restore_latest(target)
    assert (step, meta) == (2, {"position": 2})
    np.testing.assert_array_equal(state["w"], np.full(4, 2.0))

    # Step 4 again, from the state of step 2 on: another step, which is verified, not taken on the moved one's word.
    _save(ckpt, 4, 40)
    assert ckpt.all_steps() == [2, 4]
    meta_file = tmp_path / "4" / "meta" / "metadata"
    meta_file.write_text(meta_file.read_text().replace("40", "41"))  # the same size: only the manifest can tell
    with pytest.raises(CheckpointCorruptError, match="step 4 .* is damaged: meta/metadata"):
        ckpt.restore(target, step=4)
    ckpt.close()

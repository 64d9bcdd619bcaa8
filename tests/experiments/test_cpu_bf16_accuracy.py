"""experiments/cpu_bf16_accuracy.py: the windows, spreads and gaps it reports, on runs made up here
(expected values worked out by hand), and the commands it starts."""

import json
import os

import pytest

from experiments import cpu_bf16_accuracy as exp


def _run(losses, final, decision=None):
    return {"train_loss": [[s, l] for s, l in enumerate(losses, start=1)],
            "eval": {"eval/masked_lm_loss": [[len(losses), final]], "eval/masked_lm_accuracy": [[len(losses), 0.5]]},
            "cpu_bf16": decision}


def test_windows_average_whole_windows_and_drop_a_partial_one():
    # steps 1-2 -> (4 + 2) / 2 = 3; steps 3-4 -> (1 + 0) / 2 = 0.5; step 5 alone is dropped
    assert exp.windows([[1, 4.0], [2, 2.0], [3, 1.0], [4, 0.0], [5, 9.0]], 2) == {2: 3.0, 4: 0.5}


def test_compare_reports_the_reference_spread_and_the_gap_of_means():
    on = {"mixed_matmuls": True, "why": "x"}
    runs = {"off": {1: _run([4, 2, 1, 0], 2.0), 2: _run([6, 4, 3, 1], 4.0)},
            "auto": {1: _run([5, 3, 1, 1], 3.0, on), 2: _run([5, 3, 5, 5], 3.0, on)}}
    c = exp.compare(runs, window=2)
    # windows: off seed 1 -> 3, 0.5; off seed 2 -> 5, 2; auto -> 4, 1 and 4, 5
    assert c["steps"] == [2, 4]
    assert c["reference_spread"] == [2.0, 1.5]
    assert c["mean_loss"] == {"off": [4.0, 1.25], "auto": [4.0, 3.0]}
    gap = c["gap"]["auto"]
    assert gap["per_window"] == [0.0, 1.75] and gap["max"] == 1.75
    assert gap["windows_within_reference_spread"] == 1  # 0 <= 2.0 yes; 1.75 <= 1.5 no
    assert c["final_eval"]["off"]["loss_mean"] == 3.0
    assert c["final_eval"]["off"]["loss_sd"] == pytest.approx(1.41421, abs=1e-5)  # sample sd of 2 and 4
    assert c["final_eval"]["auto"]["loss_sd"] == 0.0
    assert c["final_eval"]["auto"]["decisions"] == [json.dumps(on, sort_keys=True)]
    assert "off" not in c.get("gap", {})
    table = exp.markdown({"configs": {"demo": c}})
    assert "| auto | bf16 matmuls: x |" in table and "1 of 2" in table
    assert "| off | none recorded (not auto) |" in table


def test_each_run_sets_its_precision_and_seed_and_pretrain_small_its_data(tmp_path):
    args = exp.parse_args(["--workdir", str(tmp_path), "--steps", "90", "--window", "10"])
    o = exp.run_overrides("pretrain_small", args, "R", "auto", 3)
    assert (o["cpu_bf16"], o["seed"], o["num_train_steps"], o["warmup_steps"]) == ("auto", 3, 90, 9)
    assert o["train_data"] == os.path.join("R", "train", "*.tfrecord*") and o["log_every_steps"] == 10
    assert exp.run_overrides("demo", args, "R", "off", 1) == {"cpu_bf16": "off", "seed": 1}
    cmd = exp.command("demo", "W", {"cpu_bf16": "off", "seed": 1})
    assert cmd[1:] == ["-m", "bert_jax.main", "--config=configs/demo.py", "--workdir=W",
                       "--config.cpu_bf16=off", "--config.seed=1"]

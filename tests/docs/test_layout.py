"""bert_jax.layout spells every file and folder name of a workdir: the names as runs have always
written them, and no module that writes or reads a workdir spells one of them again."""

import os
import re

import pytest

from bert_jax import layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_names_are_the_ones_runs_wrote():
    assert (layout.VERIFIED_DATA, layout.verified_data_file(3)) == ("verified_data", "process_3.json")
    assert (layout.PREDICTIONS, layout.scores_file("dev")) == ("predictions", "dev_scores.json")
    assert (layout.CURVES, layout.EVENTS_PREFIX) == ("curves.png", "events.out.tfevents")
    assert (layout.DEMO_CORPUS, layout.DEMO_DATA, layout.FILL_MASK) == ("corpus", "data", "fill_mask.json")
    assert (layout.attempt_logs(2), layout.worker_log(0)) == ("attempt-2", "worker-0.log")
    assert layout.code_archive("abc") == "abc.tar.gz"


# Every name layout defines, as a quoted string or the start of an f-string; but for the words these
# modules also use as values (`predict_params="best"`, the "data" mesh axis, tar's filter="data", ...).
WORDS = {"best", "params", "data", "code"}
NAMES = sorted({v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)} - WORDS | {
    "process_", "_scores.json", "attempt-", "worker-", ".tar.gz"})
MODULES = ["bert_jax/pretrain/feed.py", "bert_jax/finetune/predict.py", "bert_jax/finetune/restarts.py",
           "bert_jax/workdir.py", "bert_jax/pod/supervisor.py", "bert_jax/pod/slice_recovery.py",
           "bert_jax/pod/progress.py", "bert_jax/pod/pins.py", "bert_jax/demo.py", "bert_jax/plot.py"]


@pytest.mark.parametrize("module", MODULES)
def test_no_workdir_name_is_spelled_outside_layout(module):
    code = "\n".join(line for line in open(os.path.join(ROOT, module), encoding="utf-8").read().splitlines()
                     if not line.lstrip().startswith("#"))
    code = re.sub(r'"""(.|\n)*?"""', "", code)  # docstrings may name the files
    spelled = [n for n in NAMES if re.search(r'f?"' + re.escape(n) + r'(["{.])', code)
               or re.search(r'f?"[^"\n]*\}' + re.escape(n) + r'"', code)]
    assert not spelled, f"{module} spells {spelled}: use bert_jax.layout's"

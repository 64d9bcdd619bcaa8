"""The README and docs/ stay true: the configuration reference lists every field of configs/base.py,
every command they show names flags and config keys that exist, their links resolve, and the test
command CI runs is the one the README shows."""

import ast
import re
from pathlib import Path

import pytest

from bert_jax.config_overrides import unknown_overrides
from configs import base
from tests.helpers import markdown_pages
from tests.helpers.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md"] + DOCS


def _flatten(d, prefix=""):
    """Every leaf key of a config, dotted (`model.hidden_size`, `mesh.data`, `task_options.n_best_size`)."""
    out = set()
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out.add(prefix + k)
    return out


def _listed(text: str) -> set:
    """The keys of a reference table's rows: the first cell's backticked names."""
    return {key for cell in re.findall(r"^\| (`[^|]+) \|", text, re.M) for key in re.findall(r"`([\w.]+)`", cell)}


def test_configuration_reference_lists_every_base_field():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    section = doc[:doc.index("## Fine-tuning")]
    listed = _listed(section)
    fields = _flatten(base.get_config().to_dict())
    assert fields - listed == set(), f"fields missing from docs/configuration.md: {sorted(fields - listed)}"
    assert listed - fields == set(), f"docs/configuration.md lists fields base.py does not have: {sorted(listed - fields)}"


def test_configuration_reference_lists_every_key_of_every_config_file():
    import importlib

    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = {}
    for path in sorted((ROOT / "configs").glob("*.py")):
        if path.stem.startswith("_"):
            continue
        module = importlib.import_module(f"configs.{path.stem}")
        for variant in getattr(module, "KINDS", (None,)):  # configs/own_data.py:KIND
            config = module.get_config(variant) if variant else module.get_config()
            for key in _flatten(config.to_dict()):
                if key not in _listed(doc):
                    missing.setdefault(key, []).append(path.name + (f":{variant}" if variant else ""))
    assert not missing, missing


def test_ci_runs_the_readme_test_command():
    block = README.split("<!-- test-command -->", 1)[1].split("<!-- /test-command -->", 1)[0]
    assert re.search(r"^python -m pytest -q (-n \d+ )?tests$", block, re.M), block
    assert "test-command" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_is_a_door():
    assert len(README.splitlines()) <= 250
    for page in ("model", "data", "pretraining", "finetuning", "checkpoints", "performance", "troubleshooting",
                 "configuration", "reliability"):
        assert f"(docs/{page}.md" in README, page


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: broken link {target}"


# ---------------------------------------------------------------------------------------------
# Commands: every `python -m MODULE --flag` / `python path/X.py --flag` in a code block
# ---------------------------------------------------------------------------------------------


def _module_file(words):
    if words[:1] == ["-m"] and len(words) > 1:
        path = ROOT / (words[1].replace(".", "/") + ".py")
        return (path if path.exists() else None), words[2:]
    if words and words[0].endswith(".py"):
        return ROOT / words[0], words[1:]
    return None, words


def _defined_flags(path: Path, seen=None) -> set:
    """Flag names the file defines (absl DEFINE_*, argparse add_argument), and those of the
    project modules it imports (flags defined in a helper module count for its CLI)."""
    seen = set() if seen is None else seen
    if path in seen or not path.exists():
        return set()
    seen.add(path)
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if attr.startswith("DEFINE") and strings:
                names.add(strings[0])
                if "bool" in attr:
                    names.add("no" + strings[0])
            elif attr == "add_argument":
                names |= {s.lstrip("-").replace("-", "_") for s in strings if s.startswith("--")}
                names |= {s.lstrip("-") for s in strings if s.startswith("--")}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""])
            for m in modules:
                if m.split(".")[0] in ("bert_jax", "data_pipeline", "benchmarks", "experiments"):
                    for candidate in (ROOT / (m.replace(".", "/") + ".py"), ROOT / m.replace(".", "/") / "__init__.py"):
                        names |= _defined_flags(candidate, seen)
    return names


def _all_commands():
    out = []
    for page in PAGES:
        for line, words in markdown_pages.commands(page.read_text()):
            path, args = _module_file(words)
            if path is not None:
                out.append((f"{page.relative_to(ROOT)}: {line.strip()}", path, args))
    return out


COMMANDS = _all_commands()


def test_the_pages_show_commands_for_every_stage():
    modules = {path.relative_to(ROOT).as_posix() for _, path, _ in COMMANDS}
    for m in ("bert_jax/main.py", "bert_jax/convert.py", "data_pipeline/create_pretraining_data.py",
              "data_pipeline/train_vocab.py", "bert_jax/extract_features.py", "bert_jax/fill_mask.py"):
        assert m in modules, m


@pytest.mark.parametrize("where,path,args", COMMANDS, ids=[c[0][:90] for c in COMMANDS])
def test_documented_commands_name_real_flags_and_config_keys(where, path, args):
    assert path.exists(), f"{where}: no such script {path}"
    flags = [a.strip("[]") for a in args if a.strip("[]").startswith("--")]
    names = {f[2:].split("=", 1)[0] for f in flags}
    if path == ROOT / "bert_jax" / "main.py":
        config = next((f.split("=", 1)[1] for f in flags if f.startswith("--config=")), None)
        assert config, f"{where}: bert_jax.main without --config"
        assert (ROOT / config.split(":")[0]).exists(), f"{where}: no config file {config}"
        argv = [f"--config={ROOT / config}"] + [f for f in flags if f.startswith("--config.")]
        assert unknown_overrides(argv) == [], where
        names = {n for n in names if not n.startswith("config")}
    unknown = names - _defined_flags(path)
    assert not unknown, f"{where}: {path.relative_to(ROOT)} defines no flag {sorted(unknown)}"


# ---------------------------------------------------------------------------------------------
# gs:// paths: refused at startup where no backend is installed, and never a local `gs:` folder
# ---------------------------------------------------------------------------------------------

_PATH_FLAGS = {"workdir", "input_file", "output_file", "vocab_file", "init_checkpoint", "input", "output",
               "config.train_data", "config.eval_data", "config.vocab_file", "config.init_checkpoint",
               "config.data_dir"}


def _in_bucket(args):
    """The command's path flags pointed into a bucket; the flags changed."""
    out, changed = [], []
    for a in args:
        name, eq, value = a.lstrip("-").partition("=")
        if eq and name in _PATH_FLAGS:
            a = f"--{name}=gs://bkt/{value.lstrip('/')}"
            changed.append(name)
        elif eq and name == "config":  # the config file: the repository's (run from another folder)
            a = f"--config={ROOT / value}"
        out.append(a)
    return out, changed


def test_no_readme_command_makes_a_local_gs_folder_without_gcsfs(tmp_path):
    """Every README command with its paths in a bucket, where gcsfs is not installed (the import
    fails): it stops before doing anything, naming one of those flags and the extra to install,
    and its working folder stays empty. (With gcsfs, the same paths reach the bucket:
    tests/pretrain/test_gcs_pretrain.py, test_storage_data.py, test_storage_convert.py, test_finetune.py
    run the commands against a Cloud Storage emulator from empty folders.)"""
    import os
    import subprocess
    import sys

    runs = []
    for where, path, args in COMMANDS:
        if not where.startswith("README"):
            continue
        args, changed = _in_bucket(args)
        if not changed:  # e.g. the planner: a config file, no path
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        cwd = tmp_path / f"cmd{len(runs)}"
        cwd.mkdir()
        code = ("import runpy, sys; sys.modules['gcsfs'] = None; "
                f"sys.argv = [{module!r}] + {args!r}; runpy.run_module({module!r}, run_name='__main__')")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
        runs.append((where, changed, cwd, proc))
    assert len(runs) >= 12, [r[0] for r in runs]
    for where, changed, cwd, proc in runs:
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode != 0, f"{where}: ran with gs:// paths and no gcsfs\n{out[-2000:]}"
        assert "gs:// paths need the gcsfs package" in out and "pip install 'bert_jax[gcs]'" in out, (where, out[-2000:])
        assert any(f"{'--' if not c.startswith('config.') else ''}{c}=gs://bkt/" in out for c in changed), (where, out[-2000:])
        assert list(cwd.iterdir()) == [], (where, list(cwd.iterdir()))


# The README's pretraining path, run in order as written
# ---------------------------------------------------------------------------------------------

# What the test changes in the commands: the sizes (a BERT-Tiny-like model, a few steps, a small
# corpus) and the absolute paths (into the test's folder). File names, globs and the order are the
# README's own.
_TINY = {"data_pipeline.create_pretraining_data": {"dupe_factor": "2"},
         "configs/glue.py": {"config.max_seq_length": "16", "config.global_batch_size": "8",
                             "config.num_train_epochs": "2", "config.learning_rate": "1e-2",
                             "config.log_every_steps": "1", "config.xla_backend_optimization_level": "0"},
         "configs/base.py": {"config.model.hidden_size": "32", "config.model.num_hidden_layers": "2",
                           "config.model.num_attention_heads": "4", "config.model.intermediate_size": "64",
                           "config.model.max_position_embeddings": "128", "config.global_batch_size": "8",
                           "config.num_train_steps": "4", "config.warmup_steps": "1",
                           "config.checkpoint_every_steps": "4", "config.eval_every_steps": "4",
                           "config.eval_steps": "2", "config.log_every_steps": "1",
                           "config.shuffle_buffer_size": "64"}}


def test_the_readme_pretraining_path_runs_in_order_as_written(tmp_path):
    """Common tasks, in order: vocabulary -> train and eval records -> pretraining -> evaluation
    -> the pretrained model exported in Google's TF1 format (docs/checkpoints.md's command), which
    then stands in for the release the README names (`uncased_L-12_H-768_A-12`) -> importing it
    (bit for bit the pretrained parameters) -> HF export -> fill-mask on it -> fine-tuning it on
    SST-2 -> predicting new text -> exporting the fine-tuned classifier (best and last), which
    transformers' AutoModelForSequenceClassification loads and whose predictions (with
    transformers' own tokenizer) are the predict mode's. Each command is the README's as written
    (the data names, globs and checkpoint names included; docs/checkpoints.md's for the two it
    lacks), run from one folder holding `corpus/`, `heldout/`, `glue/SST-2/` and `reviews.txt`.
    The docs pages' walk-throughs are these same commands (tests/docs/test_docs_walkthroughs.py)."""
    import json
    import os
    import random
    import shutil
    import subprocess
    import sys

    import flax
    import numpy as np

    from bert_jax import convert as convert_lib

    rng = random.Random(0)
    words = [f"w{i}" for i in range(200)]
    for folder, files, docs in (("corpus", 2, 40), ("heldout", 1, 30)):
        (tmp_path / folder).mkdir()
        for f in range(files):
            text = "\n\n".join("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 12))) + " ."
                                         for _ in range(rng.randint(3, 8))) for _ in range(docs))
            (tmp_path / folder / f"part-{f}.txt").write_text(text + "\n")
    section = markdown_pages.section(README, "## Common tasks")
    wanted = ["data_pipeline.train_vocab", "data_pipeline.create_pretraining_data",
              "data_pipeline.create_pretraining_data", "bert_jax.main", "bert_jax.main"]
    commands = [(words_[1], words_[2:]) for _, words_ in markdown_pages.commands(section) if words_[:1] == ["-m"]]
    runs = [c for c in commands if c[0] in wanted][:5]
    assert [m for m, _ in runs] == wanted, commands
    convert = next(a for m, a in commands if m == "bert_jax.convert" and "--output_format=hf" in a
                   and "--input=/tmp/bert_base" in a)
    release = "uncased_L-12_H-768_A-12"
    imported = next(a for m, a in commands if m == "bert_jax.convert" and f"--input={release}" in a)
    fill = next(a for m, a in commands if m == "bert_jax.fill_mask")
    checkpoints = [w[2:] for _, w in markdown_pages.commands((ROOT / "docs" / "checkpoints.md").read_text())
                   if w[:2] == ["-m", "bert_jax.convert"]]
    to_google = next(a for a in checkpoints if "--input=/tmp/bert_base" in a and "--output_format=google" in a)
    export_last = next(a for a in checkpoints if "--input=/tmp/sst2" in a and "--finetuned=last" in a)

    def local(value: str) -> str:  # /tmp/bert_base -> <test folder>/tmp/bert_base
        return str(tmp_path / value.lstrip("/")) if value.startswith("/tmp/") else value

    def run(module, args):
        config_file = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
        tiny = dict(_TINY.get(config_file or module, {}))
        out = []
        for a in args:
            name, eq, value = a.lstrip("-").partition("=")
            if name == "config":  # the repository's file (not a /tmp path to move, wherever it is)
                out.append(f"--config={ROOT / value}")
                continue
            out.append(f"--{name}={local(tiny.pop(name, value))}" if eq else a)
        out += [f"--{k}={v}" for k, v in tiny.items()]  # sizes the command leaves to its config
        r = subprocess.run([sys.executable, "-m", module, *out], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
                                                 XLA_FLAGS=xla_flags(1)))
        assert r.returncode == 0, f"{module} {out}\n{r.stderr[-3000:]}"
        return r

    for module, args in runs:
        run(module, args)
    assert len(list((tmp_path / "data" / "train").glob("train-*.tfrecord"))) == 16
    assert (tmp_path / "data" / "eval" / "eval.tfrecord").exists()
    logged = [json.loads(line) for line in (tmp_path / "tmp/bert_base/train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]
    evaluated = json.loads((tmp_path / "tmp/eval/eval_results.json").read_text())
    assert 0.0 <= evaluated["masked_lm_accuracy"] <= 1.0 and evaluated["masked_lm_loss"] > 0
    # The README's later lines name a released Google checkpoint: here, the model just pretrained,
    # exported in Google's format by docs/checkpoints.md's command and put where a download would be.
    run("bert_jax.convert", to_google)
    (tmp_path / release).mkdir()  # the files of Google's zips, no more (casing from the vocabulary)
    for name in ("bert_config.json", "vocab.txt", "bert_model.ckpt.index"):
        shutil.copy(tmp_path / "tmp/bert_base_tf" / name, tmp_path / release)
    for data in (tmp_path / "tmp/bert_base_tf").glob("bert_model.ckpt.data-*"):
        shutil.copy(data, tmp_path / release)
    run("bert_jax.convert", imported)  # Google's release -> ours, as written
    ours = convert_lib.load_pretrained(str(tmp_path / "tmp/bert_base"))
    back = convert_lib.load_pretrained(str(tmp_path / "tmp/google_base"))
    flat = lambda p: dict(flax.traverse_util.flatten_dict(p.params))  # noqa: E731
    assert flat(back).keys() == flat(ours).keys() and back.config == ours.config
    for key, value in flat(ours).items():  # the round trip through Google's format is exact
        np.testing.assert_array_equal(np.asarray(flat(back)[key]), np.asarray(value), err_msg=str(key))
    run("bert_jax.convert", convert)
    assert (tmp_path / "tmp/bert_base_hf/config.json").exists()
    r = run("bert_jax.fill_mask", fill + ["--text=w1 w2 [MASK] w3 ."])
    lines = r.stdout.splitlines()
    guesses = [line for line in lines if line.startswith("    [MASK] -> ")]
    assert len(guesses) == 2 and all(line.count("(0.") + line.count("(1.") == 5 for line in guesses), r.stdout
    assert "The capital of France is [MASK]." in lines and "w1 w2 [MASK] w3 ." in lines

    # Fine-tune the pretrained model on a toy SST-2 (w1 -> 1, w2 -> 0), predict, export.
    def sentences(n):
        rows = [(" ".join(rng.choice(words[3:40]) for _ in range(5)), i % 2) for i in range(n)]
        return [(f"{'w1' if y else 'w2'} {text}", y) for text, y in rows]

    glue = tmp_path / "glue" / "SST-2"
    glue.mkdir(parents=True)
    for split, n in (("train", 48), ("dev", 16)):
        (glue / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in sentences(n)))
    (tmp_path / "reviews.txt").write_text("".join(t + "\n" for t, _ in sentences(6)))
    finetune = next(a for m, a in commands if m == "bert_jax.main" and "--config.task=sst2" in a)
    predict = next(a for m, a in commands if m == "bert_jax.main" and "--config.mode=predict" in a)
    export = next(a for m, a in commands if m == "bert_jax.convert" and "--input=/tmp/sst2" in a)
    run("bert_jax.main", finetune)  # from the Google-format "release", as written
    assert json.loads((tmp_path / "tmp/sst2/eval_results.json").read_text())["accuracy"] >= 0.0
    run("bert_jax.main", predict)
    rows = [line.split("\t") for line in (tmp_path / "tmp/sst2/predictions/sst2_reviews_predictions.tsv")
            .read_text().splitlines()[1:]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5", "6"] and {r[1] for r in rows} <= {"0", "1"}
    run("bert_jax.convert", export)
    transformers = pytest.importorskip("transformers")
    hf_dir = str(tmp_path / "tmp/sst2_hf")
    model = transformers.FlaxAutoModelForSequenceClassification.from_pretrained(hf_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    batch = tokenizer((tmp_path / "reviews.txt").read_text().splitlines(), padding="max_length", max_length=16,
                      truncation=True, return_tensors="np")
    logits = model(**batch).logits
    assert [model.config.id2label[int(i)] for i in logits.argmax(-1)] == [r[1] for r in rows]
    run("bert_jax.convert", export_last)  # docs/checkpoints.md: the last state instead of the best epoch
    last = transformers.FlaxAutoModelForSequenceClassification.from_pretrained(str(tmp_path / "tmp/sst2_hf_last"))
    assert last.config.id2label == model.config.id2label
    assert last(**batch).logits.shape == logits.shape

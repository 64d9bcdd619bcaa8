"""The README and docs/ stay true: the configuration reference lists every field of configs/base.py,
every command they show names flags and config keys that exist, their links resolve, and the test
command CI runs is the one the README shows."""

import ast
import re
import shlex
from pathlib import Path

import pytest

from bert_jax.config_overrides import unknown_overrides
from configs import base

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md"] + DOCS


def _flatten(d, prefix=""):
    out = set()
    for k, v in d.items():
        if isinstance(v, dict) and k == "model":
            out |= _flatten(v, f"{k}.")
        else:
            out.add(prefix + k)
    return out


def test_configuration_reference_lists_every_base_field():
    section = (ROOT / "docs" / "configuration.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+)` \|", section, re.M))
    fields = _flatten(base.get_config().to_dict())
    assert fields - listed == set(), f"fields missing from docs/configuration.md: {sorted(fields - listed)}"
    assert listed - fields == set(), f"docs/configuration.md lists fields base.py does not have: {sorted(listed - fields)}"


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
# Commands: every `python -m MODULE --flag` / `python benchmarks/X.py --flag` in a code block
# ---------------------------------------------------------------------------------------------


def _commands(text: str):
    """Shell commands of the fenced code blocks, continuation lines joined, comments dropped."""
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an unbalanced quote in a non-shell block (e.g. python output)
                continue
            if "python" in words:
                yield line, words[words.index("python") + 1:]


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
                if m.split(".")[0] in ("bert_jax", "data_pipeline"):
                    for candidate in (ROOT / (m.replace(".", "/") + ".py"), ROOT / m.replace(".", "/") / "__init__.py"):
                        names |= _defined_flags(candidate, seen)
    return names


def _all_commands():
    out = []
    for page in PAGES:
        for line, words in _commands(page.read_text()):
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
    tests/test_gcs_pretrain.py, test_storage_data.py, test_storage_convert.py, test_finetune.py
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

"""The docs' walk-throughs, run in order as written (issue 42): each page's commands with their own
file names and globs, from one folder, on a small corpus the test makes.

docs/data.md: train a vocabulary -> the Python tokenization snippet on it -> training records (16
shards named as the page says, the run's `train.dataset_info.json` beside them) and evaluation
records, each in its own folder -> the many-runs loop (two runs at once into one folder, read through
one glob). What the test changes: the optional flags the page shows in brackets are left out, and
`lines` (the snippet's free name) is the corpus's lines. The Beam command (an alternative to the
local one, tested against it in tests/data_pipeline/pretraining_data/test_beam_pipeline.py), the Chinese whole-word
masking one (tests/data_pipeline/pretraining_data/test_chinese_whole_word_mask.py) and the tokenizer.json one
(tests/data_pipeline/tokenization/test_hf_tokenizer.py) are not run here.

docs/pretraining.md, finetuning.md and checkpoints.md: their walk-throughs (pretrain -> evaluate;
fine-tune SST-2 -> predict; convert, export the fine-tuned model) are, command for command, the
README's, which tests/docs/test_readme.py::test_the_readme_pretraining_path_runs_in_order_as_written
runs in order (with the two conversions only docs/checkpoints.md shows); here, that they are the
same commands and that each page's inputs are what the page before it writes.
"""

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import markdown_pages

ROOT = Path(__file__).resolve().parents[2]


def test_the_data_page_runs_in_order_as_written(tmp_path):
    page = (ROOT / "docs" / "data.md").read_text()
    rng = random.Random(0)
    words = ["hello", "world", "héllo", "wörld"] + [f"w{i}" for i in range(150)]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "heldout").mkdir()
    for folder, f in (("corpus", 0), ("corpus", 1), ("heldout", 0)):
        docs = ("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 12))) + " , !"
                          for _ in range(rng.randint(3, 8))) for _ in range(30))
        (tmp_path / folder / f"part-{f}.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")

    tokenization = markdown_pages.section(page, "## Tokenization and vocabularies")
    preparation = markdown_pages.section(page, "## Data preparation").split("### Apache Beam runner")[0]
    vocab = [w for _, w in markdown_pages.commands(tokenization) if w[:2] == ["-m", "data_pipeline.train_vocab"]]
    records = [w for _, w in markdown_pages.commands(preparation)
               if w[:2] == ["-m", "data_pipeline.create_pretraining_data"]]
    assert len(vocab) == 1 and len(records) == 2, (vocab, records)

    def run(words):
        args = [w for w in words if not (w.startswith("[") and w.endswith("]"))]  # optional flags
        r = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2"))
        assert r.returncode == 0, f"{args}\n{r.stderr[-3000:]}"

    run(vocab[0])
    assert len((tmp_path / "vocab.txt").read_text(encoding="utf-8").splitlines()) == 30522

    # The snippet, as written, on the vocabulary just trained (which has "hello" and "world").
    snippet = re.search(r"```python\n(.*?)```", tokenization, re.S).group(1)
    lines = (tmp_path / "corpus" / "part-0.txt").read_text(encoding="utf-8").splitlines()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        scope = {"lines": lines}
        exec(compile(snippet, "docs/data.md", "exec"), scope)  # pylint: disable=exec-used
    finally:
        os.chdir(cwd)
    assert scope["tokens"] == ["hello", ",", "world", "!"]  # what the snippet's comment says
    assert scope["ids"] == scope["tok"].convert_tokens_to_ids(["hello", ",", "world", "!"])
    assert [start for start, _ in scope["spans"]] == [0, 5, 7, 12]  # "Héllo, wörld!" in the original text
    assert scope["fast"].encode_batch(lines) == [scope["tok"].convert_tokens_to_ids(scope["tok"].tokenize(x))
                                                 for x in lines]

    for command in records:
        run(command)
    names = sorted(p.name for p in (tmp_path / "data" / "train").glob("train-*.tfrecord"))
    # The names the page gives, and its glob finds them all.
    assert names == [f"train-{i:05d}-of-00016.tfrecord" for i in range(16)], names
    # The run's manifest beside them lists each file with its size and SHA-256, as the page says.
    for folder, listed in (("train", names), ("eval", ["eval.tfrecord"])):
        files = json.loads((tmp_path / "data" / folder / f"{folder}.dataset_info.json").read_text())["files"]
        assert sorted(files) == listed
        for name, entry in files.items():
            raw = (tmp_path / "data" / folder / name).read_bytes()
            assert (entry["num_bytes"], entry["sha256"]) == (len(raw), hashlib.sha256(raw).hexdigest()), name

    # The many-runs loop as written (its runs in the background, at once), by bash; then the
    # trainer's check reads both runs' records through the glob the page gives.
    many = page.split("### Many runs into one folder", 1)[1].split("\n### ", 1)[0]
    loop = re.search(r"```bash\n(.*?)```", many, re.S).group(1)
    assert "--config.train_data='data/many/part-*.tfrecord'" in many
    r = subprocess.run(["bash", "-c", f'python() {{ "{sys.executable}" "$@"; }}\n{loop}'], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "data" / "many").iterdir()) == [
        "part-0.dataset_info.json", "part-0.tfrecord", "part-1.dataset_info.json", "part-1.tfrecord"]
    made = sum(json.loads((tmp_path / "data" / "many" / f"part-{i}.dataset_info.json").read_text())["num_instances"]
               for i in range(2))
    check = subprocess.run(
        [sys.executable, "-c", "from data_pipeline.records import reader; print(reader.check_files("
         "'data/many/part-*.tfrecord', process_index=0, process_count=1, verify=True, skip_corrupt=False, "
         "require_files_per_host=True).read_records)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2"))
    assert check.returncode == 0 and int(check.stdout.split()[-1]) == made > 0, check.stderr[-3000:]

    # docs/pretraining.md's next step reads these files under these names.
    pretrain = [w for _, w in markdown_pages.commands((ROOT / "docs" / "pretraining.md").read_text())
                if w[:2] == ["-m", "bert_jax.main"]][0]
    flags = dict(w[2:].split("=", 1) for w in pretrain if w.startswith("--config."))
    assert sorted(tmp_path.glob(flags["config.train_data"])) == sorted((tmp_path / "data" / "train").glob("*.tfrecord"))
    assert sorted(tmp_path.glob(flags["config.eval_data"])) == [tmp_path / "data" / "eval" / "eval.tfrecord"]
    assert (tmp_path / flags["config.vocab_file"]).exists()


def _page_commands(path) -> list:
    return [" ".join(words) for _, words in markdown_pages.commands((ROOT / path).read_text()) if words[:1] == ["-m"]]


def test_the_pretraining_finetuning_and_checkpoint_pages_walk_the_readme_path():
    """Each page's walk-through is the README's commands (so the README's in-order test runs them),
    and the data page's records are the README's."""
    readme = _page_commands("README.md")
    data = _page_commands("docs/data.md")
    pretraining = _page_commands("docs/pretraining.md")
    finetuning = _page_commands("docs/finetuning.md")
    checkpoints = _page_commands("docs/checkpoints.md")
    walks = {
        "data": [c for c in data if "create_pretraining_data" in c and "--runner=beam" not in c
                 and "--chinese_whole_word_mask" not in c and "--tokenizer_json" not in c
                 and "$i" not in c],  # not the many-runs loop
        "pretraining": pretraining,  # pretrain, then evaluate its checkpoint
        "finetuning": [c for c in finetuning if "--config.task=sst2" in c or "--workdir=/tmp/sst2" in c],
        "checkpoints": [c for c in checkpoints if "bert_jax.convert" in c and "--output_format=google" not in c
                        and "--finetuned=last" not in c and "my_tf1_run" not in c and "--output=/tmp/base " not in c],
    }
    assert [len(walks[k]) for k in walks] == [2, 2, 2, 3], walks
    for page, commands in walks.items():
        for command in commands:
            assert command in readme, f"docs/{page}.md: {command!r} is not the README's"

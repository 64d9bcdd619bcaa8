"""Fine-tuning ModernBERT with its own kind of tokenizer: a HuggingFace `tokenizer.json` (byte-level BPE),
data_pipeline/tasks/tokenizer_json.py, through every task family.

The tokenizer is trained here with the `tokenizers` library on the tests' words: ModernBERT's layout
(ByteLevel pre-tokenizer, a TemplateProcessing post-processor "[CLS] $A [SEP]" / "[CLS] $A [SEP] $B
[SEP]"), its special tokens appended after the learned ones (ids 43-47, none of BERT's 0-4, so a BERT id
taken for granted shows), 48 ids in all: the tiny ModernBERT fixture's vocab_size. The references are
transformers' (`PreTrainedTokenizerFast(tokenizer_file=...)`): its `encode` of texts and pairs, its
`char_to_token` for SQuAD's answers, its `word_ids()` for NER's first sub-tokens, and `AutoTokenizer`
on the export.
"""

import json

import numpy as np
import pytest

from bert_jax.finetune import loop as finetune
from bert_jax.formats import modernbert_hf
from bert_jax.model.modernbert import ModernBertForTask
from configs import glue as glue_config
from configs import ner as ner_config
from configs import squad as squad_config
from configs import swag as swag_config
from data_pipeline import tasks as tasks_lib
from data_pipeline.tasks import tokenizer_json
from tests.helpers import modernbert_fixture
from tests.helpers.finetune_inputs import WORDS, sst2_files, tiny
from tests.helpers.modernbert_finetune import (best_epoch, check_scores, conll_files, loop_loss, squad_files,
                                              squad_overrides, stsb_files, swag_files)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("compilation_cache")  # tests/finetune/conftest.py

SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
MAX_LEN = 64  # the fixture's max_position_embeddings: BPE on 23 letters makes short pieces


def train_tokenizer(path):
    """A byte-level BPE tokenizer.json of 48 ids: 43 learned from the tests' words, then the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [" ".join(WORDS)] * 3 + ["he sat on the mat then he walks away", "who did it"]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=43, show_progress=False))
    tokenizer.add_special_tokens(SPECIALS)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer.save(str(path))
    assert tokenizer.get_vocab_size() == 48 and cls >= 43
    return str(path)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """{"dir": the fixture's ModernBERT folder holding the tokenizer.json and no vocab.txt, "file": it, "hf":
    transformers' fast tokenizer on it (the reference)}."""
    root = tmp_path_factory.mktemp("bpe")
    folder = modernbert_fixture.checkpoint(str(root / "hf"))
    path = train_tokenizer(root / "hf" / "tokenizer.json")
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=path, pad_token="[PAD]")
    return {"dir": folder, "file": path, "hf": reference}


def featurized(config_module, name, data, bpe, split="train", training=True, max_len=MAX_LEN, **options):
    config = config_module.get_config()
    config.task, config.data_dir = name, str(data)
    for k, v in options.items():
        config.task_options[k] = v
    task = finetune.make_task(config)
    examples = task.read(split)
    tokenizer = tokenizer_json.make_tokenizer(task, bpe["file"], None)
    return task, examples, task.featurize(examples, tokenizer, max_len, training=training)


def check_rows(features, expected, pad_id, row_axis_shape=None):
    """Each row's unpadded ids are `expected`'s; the padding is the file's pad id."""
    ids = features["input_ids"].reshape(-1, MAX_LEN)
    mask = features["input_mask"].reshape(-1, MAX_LEN)
    assert len(ids) == len(expected)
    for row, (got, m, want) in enumerate(zip(ids, mask, expected)):
        n = int(m.sum())
        assert got[:n].tolist() == want, row
        assert (got[n:] == pad_id).all(), row


def test_sentences_pairs_and_choices_are_transformers_encodings(tmp_path, bpe):
    """SST-2 (single), STS-B (pair), SWAG (four pairs an example), own pairs: `[CLS] a [SEP] (b [SEP])` with the
    file's ids, as transformers' encode / encode(a, b) gives them; rows padded with the file's [PAD]."""
    hf = bpe["hf"]
    pad = hf.pad_token_id
    assert pad not in (0, None)
    _, examples, f = featurized(glue_config, "sst2", sst2_files(tmp_path), bpe)
    check_rows(f, [hf.encode(e.text_a) for e in examples], pad)
    _, examples, f = featurized(glue_config, "stsb", stsb_files(tmp_path), bpe)
    assert all(e.text_b for e in examples)
    check_rows(f, [hf.encode(e.text_a, e.text_b) for e in examples], pad)
    _, examples, f = featurized(swag_config, "swag", swag_files(tmp_path), bpe)
    check_rows(f, [hf.encode(e.context, f"{e.start} {end}") for e in examples for end in e.endings], pad)
    own = tmp_path / "own.csv"  # your own pairs (config.task=regression, data_pipeline/tasks/classification.py)
    own.write_text("a,b,score\n" + "".join(f"{' '.join(WORDS[i:i + 3])},{' '.join(WORDS[i + 5:i + 7])},{i / 4}\n"
                                           for i in range(6)))
    task = tasks_lib.get_task("regression", split_files={"train": str(own)}, text_column="a", text_b_column="b",
                              label_column="score")
    examples = task.read("train")
    f = task.featurize(examples, tokenizer_json.make_tokenizer(task, bpe["file"], None), MAX_LEN, training=True)
    check_rows(f, [hf.encode(e.text_a, e.text_b) for e in examples], pad)


def test_squad_answer_spans_are_the_answers_characters_and_transformers_tokens(tmp_path, bpe):
    """Every training row holding its answer: the context's characters under its start..end tokens are the
    answer text; its tokens are those transformers' `char_to_token` gives for the answer's first and last
    characters. Postprocessing logits that point at the gold span predicts the answer text."""
    hf = bpe["hf"]
    task, examples, f = featurized(squad_config, "squad_v1", squad_files(tmp_path), bpe, max_len=40,
                                   doc_stride=8, max_query_length=8)
    assert len(f["input_ids"]) > len(examples)  # several windows an example: the spans move with them
    # Answers inside words, ending and starting at token boundaries ("par" of "paris", "ris" of "paris"):
    from data_pipeline.tasks.squad import Example
    context = "he went to paris then"
    tokens = hf(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    inside = [(s, e) for s, e in tokens if s > context.index("paris") and e < context.index(" then")]
    at = context.index("paris")
    for answer_start, answer_end in ((at, inside[0][1]), (inside[0][0], at + 5)):
        text = context[answer_start:answer_end]
        examples.append(Example(f"in{answer_start}", "who", context, [{"text": text, "answer_start": answer_start}]))
    f = task.featurize(examples, tokenizer_json.make_tokenizer(task, bpe["file"], None), 40, training=True)
    labelled = 0
    for row, (s, e) in enumerate(zip(f["start_positions"], f["end_positions"])):
        ex = examples[f["example_index"][row]]
        answer = ex.answers[0]
        if s == 0:
            continue
        labelled += 1
        assert ex.context[f["token_start_char"][row][s]:f["token_end_char"][row][e]] == answer["text"]
        context = hf(ex.context, add_special_tokens=False)
        first = context.char_to_token(answer["answer_start"])
        last = context.char_to_token(answer["answer_start"] + len(answer["text"]) - 1)
        assert f["input_ids"][row][s:e + 1].tolist() == context["input_ids"][first:last + 1]
    assert labelled >= len(examples)
    # Gold logits -> the answers: postprocess cuts them from the same offsets.
    start = np.full(f["input_ids"].shape, -10.0, np.float32)
    end = start.copy()
    rows = np.arange(len(start))
    start[rows, f["start_positions"]] = 10.0
    end[rows, f["end_positions"]] = 10.0
    start[:, 0] = end[:, 0] = -20.0  # rows without the answer: no span wins there
    predictions = task.postprocess(examples, f, {"start_logits": start, "end_logits": end})["predictions"]
    assert predictions == {ex.qas_id: ex.answers[0]["text"] for ex in examples}


def test_ner_labels_sit_on_each_words_first_token(tmp_path, bpe):
    """CoNLL rows are transformers' encoding of the words joined by spaces; the labelled positions are the
    first token of each word by its `word_ids()`, each with that word's tag."""
    hf = bpe["hf"]
    task, examples, f = featurized(ner_config, "conll2003", conll_files(tmp_path), bpe)
    assert len(f["input_ids"]) == len(examples)
    for row, ex in enumerate(examples):
        encoding = hf(" ".join(ex.words))
        assert f["input_ids"][row][:len(encoding["input_ids"])].tolist() == encoding["input_ids"]
        words = encoding.word_ids()
        firsts = [i for i, w in enumerate(words) if w is not None and (i == 0 or words[i - 1] != w)]
        assert np.flatnonzero(f["label_weights"][row]).tolist() == firsts
        assert [task.labels[f["label_ids"][row][i]] for i in firsts] == [ex.tags[words[i]] for i in firsts]
        assert len(firsts) == len(ex.words)


def exported(work, config):
    """The dev split featurized with the export's tokenizer.json, and `ModernBertForTask`'s outputs on it."""
    directory = work / "transformers"
    mb_config, params, info = modernbert_hf.load(str(directory))
    task = finetune.make_task(config)
    tokenizer = tokenizer_json.make_tokenizer(task, str(directory / "tokenizer.json"), None)
    split = tasks_lib.load_split(task, task.eval_splits[0], tokenizer, config.max_seq_length, training=False)
    f = split.features
    logits = np.asarray(ModernBertForTask(mb_config, info["kind"], info["num_outputs"]).apply(
        {"params": params}, f["input_ids"], f["input_mask"]))
    if info["kind"] == "span":
        return task, split, {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}
    return task, split, {"logits": logits[..., 0] if task.head == "regression" else logits}


def check_run(work, config, bpe):
    """The workdir and the export hold the tokenizer.json (no vocab.txt); AutoTokenizer loads the export's and
    encodes as the file does; the export's outputs on the dev split featurized with it give the loop's
    evaluation of the best epoch."""
    assert not (work / "vocab.txt").exists()
    assert (work / "tokenizer.json").read_bytes() == open(bpe["file"], "rb").read()
    exported_dir = work / "transformers"
    assert not (exported_dir / "vocab.txt").exists()
    loaded = transformers.AutoTokenizer.from_pretrained(str(exported_dir))
    for a, b in (("john smith went to paris", None), ("the good movie", "a bad film")):
        assert loaded(a, b)["input_ids"] == bpe["hf"](a, b)["input_ids"]
    assert "token_type_ids" not in loaded("the dog")
    assert (loaded.cls_token, loaded.sep_token, loaded.pad_token) == ("[CLS]", "[SEP]", "[PAD]")
    task, split, outputs = exported(work, config)
    best = best_epoch(work)
    if "loss" in best:
        assert best["loss"] == pytest.approx(loop_loss(task.head, outputs, split.features), rel=1e-4)
    check_scores(task, split, outputs, best)


def run(tmp_path, task_name, config_module, files, init, **overrides):
    # The shapes and hyper-parameters of test_modernbert_finetune.py's runs: its compiled programs are reused.
    config = tiny(config_module.get_config(), task_name, files(tmp_path), init, model_family="modernbert",
                  predict_test=False, learning_rate=3e-3, **overrides)
    finetune.run(config, str(tmp_path / "work"))
    return tmp_path / "work", config


@pytest.fixture(scope="module")
def sst2(tmp_path_factory, bpe):
    """SST-2 fine-tuned (rows packed) with the init folder's tokenizer.json."""
    return run(tmp_path_factory.mktemp("sst2"), "sst2", glue_config, sst2_files, bpe["dir"], num_train_epochs=3)


def test_classification_fine_tunes_with_the_folders_tokenizer_json_and_exports_it(sst2, bpe):
    work, config = sst2
    assert config.packing and not config.tokenizer_json and not config.vocab_file
    check_run(work, config, bpe)


def test_predict_mode_reads_the_exported_tokenizer_json(sst2, tmp_path):
    """`mode=predict` on it featurizes with the export's file: its dev accuracy is the best epoch's."""
    from bert_jax.finetune import predict
    from tests.helpers.finetune_inputs import predict_config

    work, _ = sst2
    dev = next(work.parent.glob("glue/SST-2/dev.tsv"))
    out = predict.run(predict_config(tmp_path, dev), str(work))
    assert out["scores"]["accuracy"] == pytest.approx(best_epoch(work)["accuracy"], abs=1e-9)


# Task -> (config, files, overrides): test_modernbert_finetune.py's. CoNLL's loop differs from WordPiece's
# in its features only, checked above against transformers: no run of its own (CI's time).
FAMILIES = {
    "squad_v1": (squad_config, squad_files, squad_overrides()),
    "swag": (swag_config, swag_files, {}),
}


@pytest.mark.parametrize("task_name", sorted(FAMILIES))
def test_span_and_choice_families_fine_tune_with_the_tokenizer_json(tmp_path, bpe, task_name):
    """SQuAD from the folder's tokenizer.json (answers cut from offsets in the loop's evaluation), SWAG from
    config.tokenizer_json (on a folder without one): two epochs, then `check_run`."""
    config_module, files, overrides = FAMILIES[task_name]
    init = bpe["dir"]
    if task_name == "swag":
        init = modernbert_fixture.checkpoint(str(tmp_path / "no_tokenizer"))
        overrides = dict(overrides, tokenizer_json=bpe["file"])
    work, config = run(tmp_path, task_name, config_module, files, init, num_train_epochs=2, **overrides)
    check_run(work, config, bpe)


def test_a_tokenizer_json_is_refused_where_it_cannot_apply(tmp_path, bpe):
    """Both config.tokenizer_json and config.vocab_file, a BERT run with config.tokenizer_json, a file without
    a padding token: each refused by name."""
    data = sst2_files(tmp_path)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(SPECIALS) + "\n")
    config = tiny(glue_config.get_config(), "sst2", data, bpe["dir"], model_family="modernbert",
                  tokenizer_json=bpe["file"], vocab_file=str(vocab))
    with pytest.raises(ValueError, match=r"config\.tokenizer_json=.* and config\.vocab_file=.*set one"):
        finetune.run(config, str(tmp_path / "a"))
    config = tiny(glue_config.get_config(), "sst2", data, bpe["dir"], tokenizer_json=bpe["file"])
    with pytest.raises(ValueError, match=r"config\.tokenizer_json=.*config\.model_family=modernbert"):
        finetune.run(config, str(tmp_path / "b"))
    spec = json.loads(open(bpe["file"]).read())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "[PAD]"]
    no_pad = tmp_path / "no_pad.json"
    no_pad.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="no_pad.json: no padding token"):
        tokenizer_json.TaskTokenizer(str(no_pad))

"""ModernBERT fine-tuning (`config.model_family="modernbert"`, bert_jax/finetune/modernbert_tasks.py): one
task of each family through the loop (`loop.run`, what `bert_jax.main` runs for mode=finetune) from the
tiny transformers ModernBERT of tests/fixtures/modernbert_tiny/ (vocab_size 48: a WordPiece vocabulary
of 47 entries written here), on task files written here.

Each run is checked against what does not go through the loop: the exported `W/transformers/` read back
by `bert_jax.formats.modernbert_hf` and applied by `ModernBertForTask` (the model
tests/model/test_modernbert.py checks against transformers' outputs) gives the loop's evaluation
(its loss recomputed in NumPy from those logits and the gold labels, and every metric); the sequence
head also by hand in NumPy on the encoder's hidden states; the exported config.json is one
transformers reads, naming the task class with the task's labels; with torch installed, transformers
itself predicts from it what the loop predicted.
"""

import json

import numpy as np
import pytest

from bert_jax.finetune import loop as finetune
from bert_jax.formats import modernbert_hf
from bert_jax.model.modernbert import ModernBertForTask, ModernBertModel
from configs import glue as glue_config
from configs import ner as ner_config
from configs import squad as squad_config
from configs import swag as swag_config
from tests.helpers import modernbert_fixture
from tests.helpers.finetune_inputs import WORDS, read_json, sst2_files, tiny
from tests.helpers.modernbert_finetune import (best_epoch, check_scores, conll_files, loop_loss, squad_files,
                                              squad_overrides, stsb_files, swag_files)

pytestmark = pytest.mark.usefixtures("compilation_cache")  # tests/finetune/conftest.py

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS[:42]  # 47 ids < the fixture's 48


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    """The fixture's transformers ModernBERT folder and a WordPiece vocabulary within its ids."""
    root = tmp_path_factory.mktemp("modernbert")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n")
    return {"dir": modernbert_fixture.checkpoint(str(root / "hf")), "vocab": str(vocab)}


def run(config, task, data, work, modernbert, **overrides):
    config = tiny(config, task, data, modernbert["dir"], model_family="modernbert", vocab_file=modernbert["vocab"],
                  **overrides)
    return finetune.run(config, str(work)), config


def check_learned(work, drop=0.0, dev=False):
    """The training loss of the last epoch is below the first's (by `drop`); with `dev` (a learnable
    task), the dev loss of a later epoch too."""
    history = read_json(work / "eval_history.json")
    assert len(history) >= 2
    assert history[-1]["train_loss"] < history[0]["train_loss"] - drop, history
    if dev:
        assert min(h["loss"] for h in history[1:]) < history[0]["loss"], history


def exported_outputs(work, config, task_name):
    """The dev split featurized as the task does, and the outputs `ModernBertForTask` gives on the
    exported checkpoint (unjitted, unsharded), shaped as the loop's."""
    from data_pipeline import tasks as tasks_lib

    mb_config, params, exported = modernbert_hf.load(str(work / "transformers"))
    task = finetune.make_task(config)
    split = tasks_lib.load_split(task, task.eval_splits[0], task.make_tokenizer(config.vocab_file, True),
                                 config.max_seq_length, training=False)
    f = split.features
    logits = np.asarray(ModernBertForTask(mb_config, exported["kind"], exported["num_outputs"]).apply(
        {"params": params}, f["input_ids"], f["input_mask"]))
    if exported["kind"] == "span":
        outputs = {"start_logits": logits[..., 0], "end_logits": logits[..., 1]}
    else:
        outputs = {"logits": logits[..., 0] if task.head == "regression" else logits}
    return task, split, outputs, (mb_config, params, exported)


def check_config_json(work, architecture, labels):
    transformers = pytest.importorskip("transformers")
    hf = transformers.ModernBertConfig.from_pretrained(str(work / "transformers"))
    assert hf.architectures == [architecture]
    assert hf.num_labels == len(labels)
    assert [hf.id2label[i] for i in range(hf.num_labels)] == labels
    return hf


def gelu(x):
    from scipy.special import erf
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def layer_norm(x, scale, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sst2(tmp_path_factory, modernbert):
    """SST-2 fine-tuned for 3 epochs, rows packed several a row (configs/glue.py's default)."""
    root = tmp_path_factory.mktemp("sst2")
    work = root / "work"
    results, config = run(glue_config.get_config(), "sst2", sst2_files(root), work, modernbert,
                          num_train_epochs=3, learning_rate=3e-3, predict_test=False)
    return work, config


def test_sequence_classification_packed_learns_and_its_export_gives_the_loops_evaluation(sst2):
    """The loss falls; the export gives the loop's dev loss and accuracy; its head equals a NumPy
    computation on the encoder's hidden states; config.json is transformers' with SST-2's labels."""
    work, config = sst2
    assert config.packing
    check_learned(work, drop=0.05, dev=True)
    task, split, outputs, (mb_config, params, _) = exported_outputs(work, config, "sst2")
    best = best_epoch(work)
    assert best["loss"] == pytest.approx(loop_loss(task.head, outputs, split.features), rel=1e-4)
    check_scores(task, split, outputs, best)
    # The head by hand: the [CLS] row of the encoder's hidden states, dense, GELU, norm, classifier.
    hidden = np.asarray(ModernBertModel(mb_config).apply({"params": params["model"]}, split.features["input_ids"],
                                                         split.features["input_mask"]), np.float64)
    x = hidden[:, 0] @ params["head"]["dense"]["kernel"]
    x = layer_norm(gelu(x), params["head"]["norm"]["scale"], mb_config.norm_eps)
    by_hand = x @ params["classifier"]["kernel"] + params["classifier"]["bias"]
    np.testing.assert_allclose(outputs["logits"], by_hand, rtol=1e-4, atol=1e-5)
    check_config_json(work, "ModernBertForSequenceClassification", [str(x) for x in task.labels])


def test_predict_mode_reads_the_export_and_predicts_the_best_epochs_labels(sst2, tmp_path):
    """`mode=predict` on a ModernBERT workdir (task.json: model_family): the dev file's predictions are
    the argmax of the export's logits by `ModernBertForTask`, its accuracy the best epoch's; the last
    state is refused by name."""
    from bert_jax.finetune import predict
    from tests.helpers.finetune_inputs import predict_config, tsv_rows

    work, config = sst2
    assert read_json(work / "task.json")["model_family"] == "modernbert"
    dev = next(work.parent.glob("glue/SST-2/dev.tsv"))
    out = predict.run(predict_config(tmp_path, dev), str(work))
    assert out["scores"]["accuracy"] == pytest.approx(best_epoch(work)["accuracy"], abs=1e-9)
    task, _, outputs, _ = exported_outputs(work, config, "sst2")
    rows = tsv_rows(tmp_path / "predict_out" / "sst2_dev_predictions.tsv")
    assert [r["prediction"] for r in rows] == [str(task.labels[i]) for i in outputs["logits"].argmax(-1)]
    with pytest.raises(ValueError, match="config.predict_params='last'"):
        predict.run(predict_config(tmp_path, dev, predict_params="last"), str(work))


def test_convert_points_a_finetuning_workdir_to_its_export(sst2, tmp_path):
    from bert_jax import convert
    work, _ = sst2
    assert (work / "modernbert_config.json").exists() and not (work / "bert_config.json").exists()
    with pytest.raises(ValueError, match="fine-tuning workdir: its best epoch .*transformers"):
        convert.main([f"--input={work}", f"--output={tmp_path / 'out'}", "--output_format=hf"])


def test_transformers_predicts_what_the_loop_predicted(sst2):
    """Live transformers (needs torch, absent on CI's CPU image): its logits on the export."""
    torch = pytest.importorskip("torch")
    import transformers
    work, config = sst2
    _, split, outputs, _ = exported_outputs(work, config, "sst2")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(work / "transformers")).eval()
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(split.features["input_ids"], dtype=torch.long),
                       attention_mask=torch.tensor(split.features["input_mask"], dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, outputs["logits"], rtol=1e-4, atol=1e-4)


FAMILIES = {  # task -> (config, files, overrides, transformers' class, labels of config.json (None: the task's))
    "stsb": (glue_config, stsb_files, {}, "ModernBertForSequenceClassification", ["LABEL_0"]),
    "squad_v1": (squad_config, squad_files, squad_overrides(), "ModernBertForQuestionAnswering", ["LABEL_0", "LABEL_1"]),
    "conll2003": (ner_config, conll_files, {}, "ModernBertForTokenClassification", None),
    "swag": (swag_config, swag_files, {}, "ModernBertForMultipleChoice", ["LABEL_0"]),
}


@pytest.mark.parametrize("task_name", sorted(FAMILIES))
def test_each_task_family_learns_and_its_export_gives_the_loops_evaluation(tmp_path, modernbert, task_name):
    """Pair regression (STS-B), span (SQuAD v1.1), token (CoNLL-2003), multiple choice (SWAG): two
    epochs of one batch each; the training loss falls, and the exported model's outputs give the
    loop's dev loss (where the split has one) and every metric."""
    config_module, files, overrides, architecture, labels = FAMILIES[task_name]
    work = tmp_path / "work"
    _, config = run(config_module.get_config(), task_name, files(tmp_path), work, modernbert, num_train_epochs=2,
                    learning_rate=3e-3, predict_test=False, **overrides)
    check_learned(work)
    task, split, outputs, _ = exported_outputs(work, config, task_name)
    best = best_epoch(work)
    if "loss" in best:
        assert best["loss"] == pytest.approx(loop_loss(task.head, outputs, split.features), rel=1e-4)
    check_scores(task, split, outputs, best)
    check_config_json(work, architecture, [str(x) for x in task.labels] if labels is None else labels)


@pytest.mark.parametrize("override, named", [
    ({"model.fused_ops": True}, "config.model.fused_ops"),
    ({"model.fp8": True}, "config.model.fp8"),
    ({"model.scan_layers": True}, "config.model.scan_layers"),
    ({"model.remat_policy": "full"}, "config.model.remat_policy"),
    ({"google_gelu": "tanh"}, "config.google_gelu"),
    ({"head_init": "normal"}, "config.head_init"),
    ({"model_family": "roberta"}, "config.model_family"),
])
def test_bert_only_options_are_refused_by_name(tmp_path, modernbert, override, named):
    config = tiny(glue_config.get_config(), "sst2", sst2_files(tmp_path), modernbert["dir"],
                  model_family="modernbert", vocab_file=modernbert["vocab"])
    for key, value in override.items():
        parent, _, field = key.rpartition(".")
        setattr(config.model if parent else config, field, value)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        finetune.run(config, str(tmp_path / "work"))
    assert not (tmp_path / "work" / "checkpoints").exists()


def test_a_bert_checkpoint_or_a_broken_tokenizer_json_is_refused_by_name(tmp_path, modernbert):
    """A transformers BERT folder (its config.json: model_type "bert") as a ModernBERT init checkpoint names
    the field; a ModernBERT folder whose tokenizer.json (read without a vocab.txt or config.vocab_file:
    tests/finetune/test_modernbert_tokenizer_json.py) is not one names the file."""
    data = sst2_files(tmp_path)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    config = tiny(glue_config.get_config(), "sst2", data, str(bert), model_family="modernbert",
                  vocab_file=modernbert["vocab"])
    with pytest.raises(ValueError, match=r"config\.init_checkpoint=.*not a transformers ModernBERT"):
        finetune.run(config, str(tmp_path / "a"))
    bpe_only = modernbert_fixture.checkpoint(str(tmp_path / "bpe_only"))
    (tmp_path / "bpe_only" / "tokenizer.json").write_text("{}")
    config = tiny(glue_config.get_config(), "sst2", data, bpe_only, model_family="modernbert")
    with pytest.raises(ValueError, match=r"bpe_only/tokenizer\.json: not a HuggingFace tokenizer\.json"):
        finetune.run(config, str(tmp_path / "b"))


def test_on_a_bf16_cpu_the_loop_fine_tunes_with_mixed_matmuls(tmp_path, modernbert, planted_cpu):
    """`config.cpu_bf16` reaches the loop's ModernBERT (`loop._prepare`: the model `run` trains), recorded in
    the workdir for a resumed run: "auto" takes the mixed matmuls on a planted CPU with avx512_bf16 where
    bf16 pays, "off" leaves the float32 model; config.model.mixed_matmuls (once refused) is taken as set."""
    from bert_jax import layout

    planted_cpu(["avx512_bf16"], 1.8)
    config = tiny(glue_config.get_config(), "sst2", sst2_files(tmp_path), modernbert["dir"], model_family="modernbert",
                  vocab_file=modernbert["vocab"])
    assert finetune._prepare(config, str(tmp_path / "w"))[1].mixed_matmuls is True
    assert read_json(tmp_path / "w" / layout.CPU_BF16)["mixed_matmuls"] is True
    config.cpu_bf16 = "off"
    assert finetune._prepare(config, str(tmp_path / "w_off"))[1].mixed_matmuls is False
    config.model.mixed_matmuls = True
    assert finetune._prepare(config, str(tmp_path / "w_set"))[1].mixed_matmuls is True


def test_without_an_init_checkpoint_config_model_holds_modernbert_fields():
    """No init checkpoint: config.model's fields are ModernBertConfig's (BERT's are named and refused)."""
    import ml_collections

    from bert_jax.finetune import modernbert_tasks

    config = glue_config.get_config()
    with pytest.raises(ValueError, match=r"config\.model\.attention_probs_dropout_prob .*not a field of ModernBertConfig"):
        modernbert_tasks.load(config)
    config.model = ml_collections.ConfigDict(dict(vocab_size=48, hidden_size=16, intermediate_size=24,
                                                  num_hidden_layers=2, num_attention_heads=2, local_attention=8))
    got, params, _, _ = modernbert_tasks.load(config)
    assert params is None
    assert (got.vocab_size, got.hidden_size, got.num_hidden_layers, got.local_attention) == (48, 16, 2, 8)
    assert got.global_rope_theta == 160_000.0  # transformers' default, not given

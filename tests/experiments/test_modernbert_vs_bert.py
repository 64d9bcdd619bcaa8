"""experiments/modernbert_vs_bert.py with --quick on a toy corpus written here (one run shared).

Checks the report's structure, that the two arms trained on the same batches, that their shapes
have (nearly) equal parameters, and that the equal-FLOPs step counts hold by FLOPs counted here by
hand for the quick shapes; then its GLUE stage (experiments/modernbert_vs_bert_glue.py) on a toy
SST-2 written here: per-seed scores, the same settings for both arms, and fine-tuning that starts
from the parameters each arm had at its equal-time mark (and at step 0 for the random arm). No
wall-clock assertion: the run's seconds are whatever the machine gives.
"""

import math
import shlex

import numpy as np
import pytest

from experiments import modernbert_vs_bert as exp, modernbert_vs_bert_glue as glue

WORDS = ("the a cat dog sat ran on under mat house good bad film story king queen said went "
         "to of and was is it he she they we red blue green old new").split()


def sentence(rng, n=7):
    return " ".join(rng.choice(WORDS, n)).capitalize() + "."


def write_data(root):
    """A toy corpus in the readers' three formats and a vocab.txt of its words."""
    rng = np.random.RandomState(0)
    corpus = root / "corpus"
    for d in ("wikitext-2-raw", "gutenberg", "tinyshakespeare"):
        (corpus / d).mkdir(parents=True)
    wiki = []
    for a in range(10):
        wiki.append(f" = Article {a} = ")
        wiki += [" " + " ".join(sentence(rng) for _ in range(5)) for _ in range(4)]
    (corpus / "wikitext-2-raw" / "wiki.test.raw").write_text("\n".join(wiki) + "\n")
    book = ["*** START OF THIS PROJECT GUTENBERG EBOOK TOY ***", "", "CHAPTER 1", ""]
    book += [f"{sentence(rng)} {sentence(rng)}\n" for _ in range(40)]
    book += ["*** END OF THIS PROJECT GUTENBERG EBOOK TOY ***"]
    (corpus / "gutenberg" / "toy.txt").write_text("\n".join(book) + "\n")
    (corpus / "tinyshakespeare" / "input.txt").write_text(
        "".join(f"King:\n{sentence(rng)}\n{sentence(rng)}\n\n" for _ in range(80)))
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + list(".,=:")) + "\n")
    sst2 = root / "glue" / "SST-2"
    sst2.mkdir(parents=True)
    for split, n in (("train", 48), ("dev", 16)):  # positive when "good" is in the sentence
        rows = [sentence(rng, 5) for _ in range(n)]
        rows = [r + (" good" if k % 2 else " bad") for k, r in enumerate(rows)]
        (sst2 / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(
            f"{r}\t{int('good' in r.split())}\n" for r in rows))
    return corpus, vocab


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mb_vs_bert")
    corpus, vocab = write_data(root)
    report = exp.main([f"--workdir={root / 'work'}", f"--corpus_dir={corpus}", f"--vocab_file={vocab}", "--quick",
                       "--glue_tasks=sst2", f"--glue_dir={root / 'glue'}"])
    return report, sum(1 for _ in open(vocab))


def test_report_structure(run):
    report, _ = run
    assert [(r["length"], r["seed"]) for r in report["runs"]] == [(32, 0)]
    r = report["runs"][0]
    for arm in exp.ARMS:
        a = r["arms"][arm]
        marks = [p["mark"] for p in a["curve"]]
        # the start, two time marks and two FLOPs marks (their order depends on the arm's speed)
        assert marks[0] == "start" and sorted(marks[1:]) == ["flops1", "flops2", "time1", "time2"]
        assert a["equal_time"]["seconds"] >= 3.0  # trained (at least) the arm's seconds
        assert a["equal_flops"]["step"] == r["equal_flops_steps"][arm]
        assert all(math.isfinite(p["mlm_loss"]) for p in a["curve"])
        # both learned something on the same held-out set: below the start's loss
        assert a["equal_time"]["mlm_loss"] < a["curve"][0]["mlm_loss"]
        assert len(a["batch_digests"]) == a["steps"]
    assert r["load_average_1min"]["max"] >= r["load_average_1min"]["min"] > 0
    # the same held-out records at the start (same eval set; losses of two random inits, both ~log V)
    starts = [r["arms"][a]["curve"][0]["mlm_loss"] for a in exp.ARMS]
    assert all(abs(s - math.log(run[1])) < 1.0 for s in starts)
    assert "| 32 | 0 | modernbert |" in exp.markdown(report)


def test_same_batches(run):
    r = run[0]["runs"][0]
    bert, modern = (r["arms"][a]["batch_digests"] for a in exp.ARMS)
    common = min(len(bert), len(modern))
    assert common >= 10  # the calibration steps at least
    assert bert[:common] == modern[:common]
    assert len(set(bert[:common])) > 1  # digests of the batches, not of something constant
    assert r["same_batches"] == {"compared": common, "identical": common}


def _hand_flops(vocab: int) -> dict:
    """Training FLOPs of a step of the quick shapes (H 32, L 2, length 32, 5 predictions, batch 8),
    counted by hand: 2 FLOPs a multiply-add, backward twice the forward."""
    h, t, p, batch = 32, 32, 5, 8
    # BERT: per layer, Q/K/V/O 4·H² and the FFN 2·H·4H per token, scores and context 2·T·H per token;
    # the MLM head's transform H² and decoder H·V at the predictions; the pooler H² and NSP 2·H once
    bert_layer = 2 * t * (4 * h * h + 2 * h * 128) + 2 * 2 * t * t * h
    bert = 2 * bert_layer + 2 * p * (h * h + h * vocab) + 2 * (h * h + 2 * h)
    # ModernBERT: GeGLU Wi H·2·85 and Wo 85·H; layer 0 attends to all 32 keys, layer 1 to its band of
    # 2·(8 // 2) + 1 = 9 keys; the head at the predictions (no pooler)
    modern_layer = 2 * t * (4 * h * h + 3 * h * 85)
    modern = 2 * modern_layer + 2 * 2 * t * (32 + 9) * h + 2 * p * (h * h + h * vocab)
    return {"bert": 3 * batch * bert, "modernbert": 3 * batch * modern}


def test_equal_flops_by_hand(run):
    report, vocab = run
    r = report["runs"][0]
    hand = _hand_flops(vocab)
    for arm in exp.ARMS:
        assert r["arms"][arm]["flops_per_step"] == pytest.approx(hand[arm], rel=1e-9)
        assert r["arms"][arm]["flops_per_token"] == pytest.approx(hand[arm] / (8 * 32), rel=1e-9)
    steps = r["equal_flops_steps"]
    totals = {a: steps[a] * hand[a] for a in exp.ARMS}
    # the same FLOPs within half a step of the cheaper arm
    assert abs(totals["bert"] - totals["modernbert"]) <= 0.5 * min(hand.values())
    for arm in exp.ARMS:
        assert r["arms"][arm]["equal_flops"]["flops"] == pytest.approx(totals[arm], rel=1e-9)


def test_equal_parameters(run):
    r = run[0]["runs"][0]
    params = {a: r["arms"][a]["params"] for a in exp.ARMS}
    assert params["modernbert"] < params["bert"]  # no position or segment embeddings, no biases
    assert abs(params["bert"] - params["modernbert"]) / params["bert"] < 0.15
    assert r["arms"]["modernbert"]["shape"]["local_attention"] == 8  # a quarter of the length


def test_equal_flops_steps_rounding():
    """The budget is whole steps of the arm with the costlier step; the other arm's count rounds."""
    steps = exp.equal_flops_steps({"a": 300.0, "b": 200.0}, {"a": 1.0, "b": 1.0}, seconds=10.0)
    # a reaches 3000 FLOPs in 10 s, b 2000: the budget is 2000 -> a: 6 steps (1800), b: 1800/200 = 9
    assert steps == {"a": 6, "b": 9}


# ---------------------------------------------------------------------------------------------
# The GLUE stage
# ---------------------------------------------------------------------------------------------


def test_glue_records_have_each_seeds_score_and_the_same_settings_for_both_arms(run):
    report, _ = run
    sst2 = report["glue"]["runs"]["32_0"]["sst2"]
    assert sorted(sst2) == sorted(glue.FAMILIES)
    commands = []
    for family in glue.FAMILIES:
        assert sorted(sst2[family]) == sorted(glue.INITS)
        for init, r in sst2[family].items():
            scores = list(r["scores"].values())
            assert sorted(r["scores"]) == ["1", "2"]  # --quick's seeds, each its own run
            assert all(0.0 <= v <= 1.0 for v in scores)
            # each seed's score is its last epoch's dev accuracy, as its own run wrote it
            assert [r["results"][s]["accuracy"] for s in ("1", "2")] == scores
            assert r["mean"] == pytest.approx(np.mean(scores))
            assert r["std"] == pytest.approx(np.std(scores, ddof=1))
            argv = shlex.split(r["command"])
            assert f"--config.init_checkpoint={r['init_checkpoint']}" in argv
            assert ("--config.model_family=modernbert" in argv) == (family == "modernbert")
            commands.append(sorted(a for a in argv if not a.startswith(
                ("--config.init_checkpoint=", "--config.model_family=", "--workdir="))))
    # the same settings in every run: only the init and the family differ
    assert all(c == commands[0] for c in commands) and "--config.seeds=1,2" in commands[0]
    # ModernBERT's checkpoint went through `bert_jax.convert --output_format=hf`; BERT's is the workdir
    assert sst2["modernbert"]["pretrained"]["init_checkpoint"].endswith("pretrained_hf")
    assert "--output_format=hf" in sst2["modernbert"]["pretrained"]["convert_commands"][0]
    assert sst2["bert"]["pretrained"]["convert_commands"] == []
    table = glue.markdown(report["glue"])
    assert "| 32, 0 | SST-2 (accuracy) | modernbert | pretrained |" in table
    assert "| 32, 0 | sst2 | modernbert − bert, pretrained |" in table


def test_fine_tuning_starts_from_each_arms_saved_parameters(run):
    """What the fine-tuning loads (its own loader, from the record's init_checkpoint) is the state
    each arm had at its equal-time mark (pretrained) or before its first step (random)."""
    from bert_jax.finetune import loop

    report, _ = run
    r = report["runs"][0]
    sst2 = report["glue"]["runs"]["32_0"]["sst2"]
    for family in glue.FAMILIES:
        arm = r["arms"][family]
        saved = arm["saved"]
        assert saved["random"]["step"] == 0
        assert saved["pretrained"]["step"] == arm["equal_time"]["step"] > 0
        assert saved["pretrained"]["encoder_digest"] != saved["random"]["encoder_digest"]
        for init in glue.INITS:
            record = sst2[family][init]
            args = exp.parse_args(["--workdir=w", "--quick", f"--glue_dir={report['glue']['settings']['glue_dir']}"])
            config = glue.finetune_config(args, "sst2", family, record["init_checkpoint"], record["train_file"])
            _, _, params, _, _ = loop._prepare(config)  # what loop.run loads
            assert glue.encoder_digest(params, family) == saved[init]["encoder_digest"], (family, init)


def test_mean_and_sample_std_by_hand():
    assert glue.mean_std([0.5, 0.7]) == (pytest.approx(0.6), pytest.approx(math.sqrt(0.02)))  # (0.1² + 0.1²) / 1
    assert glue.mean_std([0.2, 0.4, 0.9]) == (pytest.approx(0.5), pytest.approx(math.sqrt((0.09 + 0.01 + 0.16) / 2)))
    assert glue.mean_std([0.3]) == (pytest.approx(0.3), None)


def test_spread_of_two_records_by_hand():
    a = {"scores": {"1": 0.50, "2": 0.60, "3": 0.70}, "mean": 0.60, "std": 0.10}
    b = {"scores": {"1": 0.65, "2": 0.75, "3": 0.85}, "mean": 0.75, "std": 0.10}
    s = glue.spread(a, b)
    assert s["delta"] == pytest.approx(0.15)
    assert s["se"] == pytest.approx(math.sqrt(2 * 0.01 / 3))
    assert s["within_seed_spread"]  # 0.65..0.70 is in both ranges
    c = dict(b, scores={"1": 0.71, "2": 0.75, "3": 0.79})
    assert not glue.spread(a, c)["within_seed_spread"]  # 0.71 is past a's best seed


def test_the_arms_fine_tune_with_the_same_config_but_family_and_init():
    args = exp.parse_args(["--workdir=w", "--lengths=128", "--seconds=1"])
    configs = {f: glue.finetune_config(args, "stsb", f, f"/ckpt/{f}", "/t.tsv").to_dict() for f in glue.FAMILIES}
    diff = {k for k in configs["bert"] if configs["bert"][k] != configs["modernbert"][k]}
    assert diff == {"model_family", "init_checkpoint"}
    assert configs["bert"]["seeds"] == (1, 2, 3) and configs["bert"]["max_seq_length"] == 128
    assert configs["bert"]["cpu_bf16"] == "off"


@pytest.mark.parametrize("flags, message", [
    (["--glue_tasks=sst3"], "--glue_tasks: 'sst3' is not a GLUE task"),
    (["--glue_inits=warm"], "--glue_inits: 'warm'"),
    (["--lengths=64", "--seconds=1"], "--glue_max_seq_length=128 is past a pretraining length"),
])
def test_bad_glue_flags_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        exp.parse_args(["--workdir=w", *flags])
    assert message in capsys.readouterr().err

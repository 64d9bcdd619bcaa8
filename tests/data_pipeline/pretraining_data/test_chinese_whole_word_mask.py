"""Chinese whole-word masking (`--chinese_whole_word_mask`, `data_pipeline/pretraining_data/chinese_words.py`).

Checked against an implementation written here from the paper's description (Cui et al. 2019:
segment the text into words, mask all characters of a chosen word, the same 15% budget and
80/10/10 per token) with its own jieba instance and its own token alignment (character offsets
from `FullTokenizer.tokenize_with_offsets`, not the gap counts the pipeline uses):

- the grouping bits, token for token, on Chinese, mixed and awkward text;
- the masking draw for draw (Google's RNG use: shuffle the candidate words, take them while they
  fit, one `random()` per token), and the reference-compatible mode's whole output byte for byte
  against Google's algorithm (`instances.create_training_instances`) run on documents grouped
  here;
- in both modes' records: every segmenter word all masked or not at all, the budget rule, the
  tokens single characters of the vocabulary; records parse with the schema's readers;
- a user dictionary's made-up word is one group; determinism per seed, 1 and 2 workers, the Beam
  runner; non-Chinese text unchanged by the flag; errors naming the flag and file; dynamic
  masking refusing records whose words it cannot know.
"""

import dataclasses
import hashlib
import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jieba = pytest.importorskip("jieba")
tf = pytest.importorskip("tensorflow")

from data_pipeline import create_pretraining_data as cpd, tokenization
from data_pipeline.input import masking
from data_pipeline.pretraining_data import chinese_words, corpora, instances
from data_pipeline.pretraining_data import shards
from data_pipeline.records import schema
from data_pipeline.tokenization.char_classes import is_cjk_char  # noqa: E402
from data_pipeline.tokenization.fast import FastTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
GOOGLE_CHINESE_VOCAB = ROOT.parent / "shared" / "data" / "vocab" / "bert-base-chinese" / "vocab.txt"
SEQ, PREDS, PROB = 64, 10, 0.15
MADE_UP = "银杏星果糕"  # jieba alone: 银杏 / 星果 / 糕

DOCUMENTS = [
    ["今天天气很好，我们一起去公园散步。", "公园里有很多人在放风筝。", "孩子们在草地上快乐地奔跑。",
     "傍晚的时候，我们在湖边看日落。"],
    ["这家餐厅的红烧肉非常好吃。", "服务员的态度也很热情。", "我们点了宫保鸡丁和麻婆豆腐。", "价格比较合理，下次还会再来。"],
    ["自然语言处理是人工智能的重要方向。", "研究人员用深度学习训练语言模型。", "我买了iPhone手机，花了5000元。",
     "这个模型在中文阅读理解任务上表现很好。"],
    ["图书馆的环境安静，适合学习。", "他每天早上八点准时到图书馆看书。", "考试之前，同学们都在认真复习。",
     "老师说，只要努力就一定会有收获。"],
    ["北京是中国的首都，有着悠久的历史。", "长城和故宫吸引了世界各地的游客。", "地铁交通非常方便，可以到达城市的每个角落。"],
    ["经常锻炼身体有助于保持健康。", "医生建议我们多吃蔬菜和水果。", "晚上早点睡觉，不要熬夜玩手机。", "跑步和游泳都是很好的运动方式。"],
    ["这家公司去年的销售额增长了百分之二十。", "经理决定明年在上海开设新的分公司。", "员工们对未来的发展充满信心。"],
    ["外卖送得很快，饭菜还是热的。", "快递小哥冒着大雨准时送到，辛苦了。", "包装很精致，味道也不错，值得推荐。",
     "就是分量有点少，希望以后能改进。"],
    ["春天来了，花园里的桃花都开了。", "小鸟在树枝上唱歌，蜜蜂在花丛中忙碌。", "农民伯伯开始在田野里播种。"],
    [f"我最喜欢吃学校门口的{MADE_UP}。", f"周末的时候妈妈也会做{MADE_UP}。", f"{MADE_UP}又香又甜，同学们都爱吃。"],
    ["昨天晚上的足球比赛非常精彩。", "主队在最后一分钟打进了制胜球。", "球迷们在体育场里欢呼庆祝。"],
    ["周末我们全家一起去奶奶家吃饭。", "奶奶做了一大桌子丰盛的菜。", "大家一边吃饭一边聊天，非常开心。"],
]
# Mixed scripts, spaces, a control character, a compatibility ideograph (U+F900), an extension-A
# ideograph (outside jieba's Han range), traditional characters, full-width punctuation.
AWKWARD = ["我用BERT模型和T恤, 3.14元 don't 自然语言处理很有趣", "  中\u0000文  混合 text\t分词  ",
           "\uf900豈是兼容字，㐀㐁是扩展A区的字。", "他說：「我們去看電影吧！」", "unaffable 人工智能 café", ""]


# ---------------------------------------------------------------------------------------------
# Fixtures and the independent implementation
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two input files (two fast-mode shards) and a vocabulary: Google's Chinese one when
    ../shared has it, else one written here (every character, a few ## pieces)."""
    root = tmp_path_factory.mktemp("zh")
    files = [str(root / "a.txt"), str(root / "b.txt")]
    corpora.write_google_text(files[0], DOCUMENTS[:6])
    corpora.write_google_text(files[1], DOCUMENTS[6:])
    if GOOGLE_CHINESE_VOCAB.exists():
        vocab = str(GOOGLE_CHINESE_VOCAB)
    else:
        chars = sorted({c.lower() for text in [s for d in DOCUMENTS for s in d] + AWKWARD for c in text
                        if not c.isspace() and c != "\u0000"})
        vocab = str(root / "vocab.txt")
        Path(vocab).write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "i", "##phone", "500", "##0",
                                          "bert", "t", "don", "3", "14"] + chars + ["##" + c for c in chars[:50]])
                               + "\n", encoding="utf-8")
    return files, vocab, tokenization.FullTokenizer(vocab, do_lower_case=True)


@pytest.fixture(scope="module")
def segmenter():
    return chinese_words.ChineseWordSegmenter()


@pytest.fixture(scope="module")
def paper_jieba():
    """The independent implementation's own jieba instance (default dictionary, HMM on)."""
    tok = jieba.Tokenizer()
    tok.tmp_dir = chinese_words._cache_dir()
    tok.initialize()
    return tok


def paper_bits(text, tok, jieba_tok):
    """Per token: continues a Chinese word (two or more ideographs, nothing else), from the
    tokens' character offsets and jieba's words over the same text."""
    tokens, spans = tok.tokenize_with_offsets(text)
    word_at, start = {}, 0
    for number, word in enumerate(jieba_tok.cut(text, HMM=True)):
        if len(word) >= 2 and all(is_cjk_char(ord(c)) for c in word):
            word_at.update({i: number for i in range(start, start + len(word))})
        start += len(word)
    assert start == len(text)
    return tokens, [t > 0 and spans[t][0] in word_at and word_at.get(spans[t - 1][0]) == word_at[spans[t][0]]
                    for t in range(len(tokens))]


def paper_masking(tokens, words_of, rng, vocab_words, budget_prob=PROB, max_predictions=PREDS):
    """The paper's masking with Google's random draws: words (jieba's; a ## piece with its word)
    in a random order, a word taken whole while it fits the 15% budget, 80/10/10 per token."""
    groups = []
    for i, t in enumerate(tokens):
        if t in ("[CLS]", "[SEP]"):
            continue
        if groups and (t.startswith("##") or words_of[i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    rng.shuffle(groups)
    budget = min(max_predictions, max(1, int(round(len(tokens) * budget_prob))))
    out, masked = list(tokens), []
    for group in groups:
        if len(masked) >= budget:
            break
        if len(masked) + len(group) > budget:
            continue
        for i in group:
            if rng.random() < 0.8:
                out[i] = "[MASK]"
            elif rng.random() < 0.5:
                pass
            else:
                out[i] = vocab_words[rng.randint(0, len(vocab_words) - 1)]
            masked.append(i)
    masked.sort()
    return out, masked, [tokens[i] for i in masked]


def google_documents(files):
    """google-research/bert's reading: one stream of stripped lines over all files, a blank line
    ends a document."""
    docs, doc = [], []
    for path in files:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                doc.append(line.strip())
            elif doc:
                docs.append(doc)
                doc = []
    return docs + ([doc] if doc else [])


def decoded(path):
    return [schema.decode_example(r.numpy()) for r in tf.data.TFRecordDataset(str(path))]


def make(tmp, files, vocab, name, **kw):
    args = dict(do_whole_word_mask=True, chinese_whole_word_mask=True, max_seq_length=SEQ,
                max_predictions_per_seq=PREDS, masked_lm_prob=PROB, dupe_factor=4, random_seed=11)
    args.update(kw)
    info = cpd.create_pretraining_data(files, str(tmp / name), vocab, **args)
    return info, tmp / name / "part-00000-of-00001.tfrecord"


# ---------------------------------------------------------------------------------------------
# Grouping and masking against the paper's description
# ---------------------------------------------------------------------------------------------


def test_word_bits_equal_an_offsets_alignment_of_jiebas_words(corpus, segmenter, paper_jieba):
    files, vocab, tok = corpus
    fast = FastTokenizer(vocab)
    grouped = 0
    for text in [s for d in DOCUMENTS for s in d] + AWKWARD:
        tokens, want = paper_bits(text, tok, paper_jieba)
        full = segmenter.continuations(text, lambda gaps: [len(tok.tokenize(g)) for g in gaps])
        quick = segmenter.continuations(text, lambda gaps: [len(x) for x in fast.encode_batch(gaps)])
        assert full == quick == want, (text, tokens, full, want)
        grouped += sum(want)
        # The marks only group: the tokens (and so the ids) are the tokenizer's, single characters for Chinese.
        marked = chinese_words.marking_tokenizer(tok, segmenter)(text)
        assert marked == tokens and [type(t) is instances.WordContinuation for t in marked] == want
    assert grouped > 150
    # A word of ideographs only groups (模型, 自然语言); "T恤" (mixed) does not; ## pieces are left to Google's rule.
    tokens = tok.tokenize(AWKWARD[0])
    bits = dict(zip(tokens, segmenter.continuations(AWKWARD[0], lambda gaps: [len(tok.tokenize(g)) for g in gaps])))
    assert bits["型"] and bits["然"] and bits["言"] and not bits["模"] and not bits["自"] and not bits["恤"]


def test_masking_is_the_papers_draw_for_draw(corpus, segmenter, paper_jieba):
    """Google's `create_masked_lm_predictions` on the marked tokens and the paper's masking written
    here, same seed: the same masked positions, labels and replacements."""
    files, vocab, tok = corpus
    vocab_words = list(tok.vocab)
    mark = chinese_words.marking_tokenizer(tok, segmenter)
    sentences = [s for d in DOCUMENTS for s in d]
    multi = 0
    for seed in range(300):
        a, b = sentences[seed % len(sentences)], sentences[(7 * seed + 3) % len(sentences)]
        ta, ba = paper_bits(a, tok, paper_jieba)
        tb, bb = paper_bits(b, tok, paper_jieba)
        tokens = ["[CLS]"] + ta + ["[SEP]"] + tb + ["[SEP]"]
        words_of = [False] + ba + [False] + bb + [False]
        want = paper_masking(tokens, words_of, random.Random(seed), vocab_words)
        ours = instances.create_masked_lm_predictions(
            ["[CLS]"] + mark(a) + ["[SEP]"] + mark(b) + ["[SEP]"], PROB, PREDS, vocab_words, random.Random(seed),
            do_whole_word_mask=True, stats=instances.MaskStats())
        assert (list(ours[0]), ours[1], list(ours[2])) == want, seed
        multi += any(words_of[p] for p in want[1])
    assert multi > 200  # most sequences mask at least one word of several characters


def test_reference_mode_is_googles_algorithm_over_jiebas_words_byte_for_byte(tmp_path, corpus, paper_jieba):
    files, vocab, tok = corpus
    info, path = make(tmp_path, files, vocab, "ref", reference_compatible=True)
    docs = []
    for doc in google_documents(files):
        sentences = []
        for line in doc:
            tokens, bits = paper_bits(line, tok, paper_jieba)
            if tokens:
                sentences.append([instances.WordContinuation(t) if b else t for t, b in zip(tokens, bits)])
        docs.append(sentences)
    want = instances.create_training_instances(
        docs, list(tok.vocab), max_seq_length=SEQ, dupe_factor=4, short_seq_prob=0.1, masked_lm_prob=PROB,
        max_predictions_per_seq=PREDS, rng=random.Random(11), do_whole_word_mask=True, stats=instances.MaskStats())
    want_records = [schema.serialize(schema.pad_features(
        tok.convert_tokens_to_ids(x.tokens), x.segment_ids, x.masked_lm_positions,
        tok.convert_tokens_to_ids(x.masked_lm_labels), int(x.is_random_next), SEQ, PREDS)) for x in want]
    got = [r.numpy() for r in tf.data.TFRecordDataset(str(path))]
    assert len(got) == len(want_records) == info["num_instances"] > 60
    assert got == want_records


# ---------------------------------------------------------------------------------------------
# Both modes' records
# ---------------------------------------------------------------------------------------------


def source_index(files, tok, jieba_tok):
    """Per document: its token ids as a string (one char per id) and the paper's word bits."""
    index = []
    for doc in google_documents(files):
        ids, bits = [], []
        for line in doc:
            tokens, b = paper_bits(line, tok, jieba_tok)
            ids += tok.convert_tokens_to_ids(tokens)
            bits += b
        index.append(("".join(map(chr, ids)), np.array(bits, bool)))
    return index


def locate(index, segment_ids):
    """The bits of a segment's tokens, when it occurs exactly once in the corpus, else None."""
    key = "".join(map(chr, segment_ids))
    hits = []
    for text, bits in index:
        start = text.find(key)
        while start >= 0:
            hits.append(bits[start:start + len(key)])
            start = text.find(key, start + 1)
    return hits[0] if len(hits) == 1 else None


@pytest.mark.parametrize("mode", ["reference_compatible", "fast"])
def test_records_mask_whole_segmenter_words_within_the_budget(tmp_path, corpus, paper_jieba, mode):
    files, vocab, tok = corpus
    info, path = make(tmp_path, files, vocab, mode, reference_compatible=mode == "reference_compatible")
    records = decoded(path)
    assert len(records) == info["num_instances"] > 60
    parsed = schema.parse_example(tf.constant([r.numpy() for r in tf.data.TFRecordDataset(str(path))]), SEQ, PREDS)
    assert parsed["input_ids"].shape == (len(records), SEQ) and parsed["masked_lm_ids"].shape == (len(records), PREDS)
    index = source_index(files, tok, paper_jieba)
    inv = {i: t for t, i in tok.vocab.items()}
    checked = whole_words = 0
    for n_rec, r in enumerate(records):
        n = int(r["input_mask"].sum())
        k = int(r["masked_lm_weights"].sum())
        pos = r["masked_lm_positions"][:k]
        source = r["input_ids"].copy()
        source[pos] = r["masked_lm_ids"][:k]
        la = int(np.argmax(r["segment_ids"])) - 2
        # The tokens are the tokenizer's: Chinese characters one token each, never a "##" piece.
        text_tokens = [inv[i] for i in source[1:n - 1].tolist() if i != tok.vocab["[SEP]"]]
        assert not any(t.startswith("##") and len(t) == 3 and is_cjk_char(ord(t[2])) for t in text_tokens), n_rec
        assert all(len(t) == 1 for t in text_tokens if any(is_cjk_char(ord(c)) for c in t)), n_rec
        assert sum(len(t) == 1 and is_cjk_char(ord(t)) for t in text_tokens) > 0.5 * len(text_tokens)
        budget = min(PREDS, max(1, round(n * PROB)))
        assert 1 <= k <= budget, n_rec
        bits_a = locate(index, source[1:la + 1].tolist())
        bits_b = locate(index, source[la + 2:n - 1].tolist())
        if bits_a is None or bits_b is None:
            continue
        checked += 1
        joins = np.zeros(n, bool)
        joins[1:la + 1], joins[la + 2:n - 1] = bits_a, bits_b
        # Words as Google forms them from the bits (B's first token may join A's last word, as a ## piece does).
        words = []
        for i in range(1, n - 1):
            if i == la + 1:
                continue
            if words and (joins[i] or inv[int(source[i])].startswith("##")):
                words[-1].append(i)
            else:
                words.append([i])
        masked = set(pos.tolist())
        for w in words:
            hit = [i in masked for i in w]
            assert all(hit) or not any(hit), (n_rec, "a word masked in part", w, sorted(masked))
            assert any(hit) or len(w) > budget - k, (n_rec, "a word that fits left unmasked", w, budget, k)
            whole_words += all(hit) and len(w) > 1
    assert checked > 0.8 * len(records), (checked, len(records))
    assert whole_words > len(records)  # more than one word of several characters per record on average
    stats = info["mask_stats"]
    assert 0.7 < stats["mask_fraction"] < 0.9 and stats["masked"] > 500


def test_user_dictionary_makes_a_made_up_word_one_group(tmp_path, corpus):
    files, vocab, tok = corpus
    plain = chinese_words.ChineseWordSegmenter()
    assert MADE_UP not in plain.words(DOCUMENTS[9][0])
    ltp = tmp_path / "ltp.txt"  # LTP style: a word per line
    ltp.write_text(f"{MADE_UP}\n\n", encoding="utf-8")
    with_freq = tmp_path / "jieba.txt"  # jieba's format
    with_freq.write_text(f"{MADE_UP} 5 n\n红烧肉 3\n", encoding="utf-8")
    count = lambda gaps: [len(tok.tokenize(g)) for g in gaps]  # noqa: E731
    for user_dict in (ltp, with_freq):
        seg = chinese_words.ChineseWordSegmenter(str(user_dict))
        assert MADE_UP in seg.words(DOCUMENTS[9][0])
        bits = seg.continuations(DOCUMENTS[9][0], count)
        start = DOCUMENTS[9][0].index(MADE_UP)
        assert bits[start:start + len(MADE_UP)] == [False] + [True] * (len(MADE_UP) - 1)
    assert MADE_UP not in plain.words(DOCUMENTS[9][0])  # the user words stayed in their own jieba instance

    info, path = make(tmp_path, files, vocab, "dict", chinese_user_dict=str(ltp), dupe_factor=8)
    assert info["chinese_segmenter"]["user_dict_sha256"] == hashlib.sha256(ltp.read_bytes()).hexdigest()
    word_ids = "".join(map(chr, tok.convert_tokens_to_ids(list(MADE_UP))))
    seen = whole = 0
    for r in decoded(path):
        k = int(r["masked_lm_weights"].sum())
        source = r["input_ids"].copy()
        source[r["masked_lm_positions"][:k]] = r["masked_lm_ids"][:k]
        masked = set(r["masked_lm_positions"][:k].tolist())
        start = "".join(map(chr, source.tolist())).find(word_ids)
        while start >= 0:
            hit = [i in masked for i in range(start, start + len(MADE_UP))]
            assert all(hit) or not any(hit), hit
            seen += 1
            whole += all(hit)
            start = "".join(map(chr, source.tolist())).find(word_ids, start + 1)
    assert seen > 10 and whole >= 1, (seen, whole)


# ---------------------------------------------------------------------------------------------
# Determinism, workers, Beam; Google's masking where there is nothing Chinese
# ---------------------------------------------------------------------------------------------


def test_same_seed_same_bytes_any_worker_count_and_the_beam_runner(tmp_path, corpus):
    files, vocab, tok = corpus
    _, one = make(tmp_path, files, vocab, "one")
    _, again = make(tmp_path, files, vocab, "again")
    _, other_seed = make(tmp_path, files, vocab, "seed", random_seed=12)
    _, plain = make(tmp_path, files, vocab, "plain", chinese_whole_word_mask=False)
    assert one.read_bytes() == again.read_bytes()
    assert one.read_bytes() != other_seed.read_bytes() and one.read_bytes() != plain.read_bytes()
    # Two forked workers through the CLI (no TensorFlow in that process).
    out = tmp_path / "two" / "part-00000-of-00001.tfrecord"
    r = subprocess.run([sys.executable, "-m", "data_pipeline.create_pretraining_data", f"--input_file={','.join(files)}",
                        f"--output_file={out}", f"--vocab_file={vocab}", "--do_whole_word_mask",
                        "--chinese_whole_word_mask", f"--max_seq_length={SEQ}", f"--max_predictions_per_seq={PREDS}",
                        "--dupe_factor=4", "--random_seed=11", "--num_workers=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Building prefix dict" not in r.stderr  # jieba's chatter stays off stderr
    assert out.read_bytes() == one.read_bytes()
    info = json.loads((tmp_path / "two" / "part.dataset_info.json").read_text())  # part-00000-of-00001: one of one
    assert info["flags"]["chinese_whole_word_mask"] is True and info["flags"]["do_whole_word_mask"] is True
    assert info["chinese_segmenter"] == {"name": "jieba", "version": jieba.__version__, "hmm": True,
                                         "user_dict_sha256": None}
    pytest.importorskip("apache_beam")
    from data_pipeline.pretraining_data import beam_pipeline
    opts = shards.Options(vocab_file=vocab, do_whole_word_mask=True, chinese_whole_word_mask=True, max_seq_length=SEQ,
                       max_predictions_per_seq=PREDS, dupe_factor=4, random_seed=11)
    beam_pipeline.run(opts, sources=[("text", f) for f in files], outputs=[str(tmp_path / "beam" / out.name)])
    assert (tmp_path / "beam" / out.name).read_bytes() == one.read_bytes()
    # The user dictionary travels inside the shard step, as the vocabulary does: Beam workers
    # elsewhere cannot read the driver's file (here it is moved away before the step runs).
    words = tmp_path / "words.txt"
    words.write_text(MADE_UP + "\n", encoding="utf-8")
    with_dict = dataclasses.replace(opts, chinese_user_dict=str(words))
    shards.init_worker(opts, 1)
    (without_chunk,), *_ = shards.shard_records((1, ("text", files[1])))
    shards.init_worker(with_dict, 1)
    (chunk,), *_ = shards.shard_records((1, ("text", files[1])))
    assert chunk != without_chunk  # the made-up word (in the second file) is one group now
    step = pickle.dumps(beam_pipeline._ProcessShard(with_dict, 1, str(tmp_path / "job")))
    words.rename(tmp_path / "moved.txt")
    list(pickle.loads(step).process((1, ("text", files[1]))))
    assert (tmp_path / "job" / "shard-0000001-bucket-00000").read_bytes() == chunk


@pytest.mark.parametrize("reference_compatible", [True, False])
def test_text_without_ideographs_is_masked_as_googles_whole_word_masking(tmp_path, reference_compatible):
    """English text (## pieces): the flag changes no byte, in either mode."""
    rng = random.Random(3)
    stems, suffixes = ["river", "stone", "cloud", "light", "paper", "garden"], ["", "s", "ing", "ed"]
    docs = [[" ".join(rng.choice(stems) + rng.choice(suffixes) for _ in range(rng.randint(3, 12))) + "."
             for _ in range(rng.randint(1, 5))] for _ in range(8)]
    text = tmp_path / "en.txt"
    corpora.write_google_text(str(text), docs)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + stems
                               + ["##" + s for s in suffixes if s]) + "\n")
    out = {}
    for flag in (False, True):
        _, path = make(tmp_path, [str(text)], str(vocab), f"en{flag}", chinese_whole_word_mask=flag,
                       reference_compatible=reference_compatible, max_seq_length=24, max_predictions_per_seq=4)
        out[flag] = path.read_bytes()
    assert out[True] == out[False] and len(out[True]) > 1000


# ---------------------------------------------------------------------------------------------
# Errors; dynamic masking
# ---------------------------------------------------------------------------------------------


def test_bad_flags_and_user_dictionaries_are_named(tmp_path, corpus):
    files, vocab, _ = corpus
    missing = str(tmp_path / "no-such-dict.txt")
    with pytest.raises(FileNotFoundError, match=r"--chinese_user_dict=.*no-such-dict\.txt"):
        make(tmp_path, files, vocab, "missing", chinese_user_dict=missing)
    assert not (tmp_path / "missing").exists()  # named before any work
    bad = tmp_path / "bad.txt"
    bad.write_text("好词\n坏 词 1 n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--chinese_user_dict=.*bad\.txt, line 2"):
        chinese_words.read_user_dict(str(bad))
    bad.write_text("零频 0\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 1: frequency 0"):
        chinese_words.read_user_dict(str(bad))
    with pytest.raises(ValueError, match="--chinese_whole_word_mask .* needs --do_whole_word_mask"):
        make(tmp_path, files, vocab, "no_wwm", do_whole_word_mask=False)
    with pytest.raises(ValueError, match="--chinese_user_dict=.* needs --chinese_whole_word_mask"):
        make(tmp_path, files, vocab, "no_flag", chinese_whole_word_mask=False, chinese_user_dict=str(bad))
    # The CLI says the same.
    r = subprocess.run([sys.executable, "-m", "data_pipeline.create_pretraining_data", f"--input_file={files[0]}",
                        f"--output_file={tmp_path / 'cli' / 'train.tfrecord'}", f"--vocab_file={vocab}",
                        "--do_whole_word_mask", "--chinese_whole_word_mask", f"--chinese_user_dict={missing}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and f"--chinese_user_dict={missing}: no such file" in r.stderr, r.stderr[-2000:]


def test_dynamic_whole_word_masking_refuses_records_whose_words_it_cannot_know(tmp_path, corpus):
    files, vocab, _ = corpus
    make(tmp_path, files, vocab, "data", dupe_factor=1)
    pattern = str(tmp_path / "data" / "*.tfrecord")
    for asked in (None, True):  # as recorded (whole words) or asked: it would mask single characters
        with pytest.raises(ValueError, match="config.dynamic_whole_word_mask=False"):
            masking.resolve_whole_word_mask(pattern, True, asked)
    assert masking.resolve_whole_word_mask(pattern, True, False) is False  # character by character, as asked
    assert masking.resolve_whole_word_mask(pattern, False, None) is False  # the records' own masks
    make(tmp_path, files, vocab, "google", dupe_factor=1, chinese_whole_word_mask=False)
    assert masking.resolve_whole_word_mask(str(tmp_path / "google" / "*.tfrecord"), True, None) is True

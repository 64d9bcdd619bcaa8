"""Tokenizer benchmark: plain vs fast throughput, fast == plain on real corpora, vocab training.

Owns the numbers in benchmarks/data/RESULTS.md for issue 3:

* speed: every line of every corpus under DATA/corpus, with both BERT vocabularies under
  DATA/vocab. `FullTokenizer` (pure Python) against `FastTokenizer` on the same lines: a cold
  pass (fresh tokenizer, empty memo, Unicode tables rebuilt) and warm passes. Both paths
  report the best of --repeats timed passes. Every line's ids must be equal. HuggingFace
  `tokenizers` (Rust BERT pipeline, 200-character words) is timed for context, with its
  count of lines that differ from Google's tokenization.
* vocab: `train_vocab` on Gutenberg + WikiText with every 20th line held out, 30522 entries,
  and the `[UNK]` rate of the held-out lines.

Usage (from the repository root):
  python -m benchmarks.data.tokenizer [--data_dir=../shared/data] [--mode=all|speed|vocab]
      [--repeats=3]
Exits 0 with a message when the data folder is absent.
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path


from data_pipeline import tokenization as tok  # noqa: E402
from data_pipeline import train_vocab as tv  # noqa: E402
from data_pipeline.tokenization import fast as fast_tokenization  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
VOCABS = (("bert-base-uncased", True), ("bert-base-cased", False))
VOCAB_CORPUS = ("gutenberg/*.txt", "wikitext-2-raw/wiki.test.raw", "wikitext-2/wiki.valid.tokens")


def corpus_lines(data_dir: Path):
    files = sorted(p for p in (data_dir / "corpus").glob("*/*")
                   if p.is_file() and "README" not in p.name)
    lines, bad = [], 0
    for path in files:
        for raw in path.read_bytes().splitlines():
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                lines.append(raw.decode("utf-8", errors="replace"))
                bad += 1
    return files, lines, bad


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def hf_tokenizer(vocab: dict, lower: bool):
    """HuggingFace's BERT pipeline configured to Google's settings (for context only)."""
    try:
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    except ImportError:
        return None
    hf = Tokenizer(models.WordPiece(vocab=dict(vocab), unk_token="[UNK]",
                                    continuing_subword_prefix="##", max_input_chars_per_word=200))
    hf.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                               strip_accents=lower, lowercase=lower)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return hf


def bench_speed(data_dir: Path, repeats: int) -> bool:
    files, lines, bad = corpus_lines(data_dir)
    print(f"corpus: {len(files)} files, {len(lines):,} lines, "
          f"{sum(map(len, lines)):,} characters, {bad} lines with invalid UTF-8, "
          f"{sum(not line.isascii() for line in lines):,} non-ASCII lines")
    all_equal = True
    for name, lower in VOCABS:
        vocab_file = str(data_dir / "vocab" / name / "vocab.txt")
        full = tok.FullTokenizer(vocab_file, do_lower_case=lower)
        # Best of `repeats` for both paths: the machine is shared, and the minimum is the
        # least disturbed run.
        t_full = float("inf")
        for _ in range(repeats):
            t_run, expected = timed(
                lambda: [full.convert_tokens_to_ids(full.tokenize(line)) for line in lines])
            t_full = min(t_full, t_run)
        n_tokens = sum(map(len, expected))

        fast_tokenization._unicode_tables.cache_clear()  # the cold pass pays for building them
        t_cold, cold = timed(
            lambda: fast_tokenization.FastTokenizer(vocab_file, do_lower_case=lower).encode_batch(lines))
        fast = fast_tokenization.FastTokenizer(vocab_file, do_lower_case=lower)
        fast.encode_batch(lines)
        t_warm = float("inf")
        for _ in range(repeats):
            t_run, warm = timed(lambda: fast.encode_batch(lines))
            t_warm = min(t_warm, t_run)
        equal_cold = sum(a == b for a, b in zip(cold, expected))
        equal_warm = sum(a == b for a, b in zip(warm, expected))
        all_equal &= equal_cold == equal_warm == len(lines)

        print(f"\n{name} (do_lower_case={lower}): {n_tokens:,} tokens, best of {repeats} "
              "(cold: one pass)")
        print(f"  FullTokenizer (pure Python)  {n_tokens / t_full:>12,.0f} tokens/s  "
              f"({t_full:.2f} s)")
        print(f"  FastTokenizer cold pass      {n_tokens / t_cold:>12,.0f} tokens/s  "
              f"({t_cold:.2f} s)  x{t_full / t_cold:.1f}")
        print(f"  FastTokenizer warm pass      {n_tokens / t_warm:>12,.0f} tokens/s  "
              f"({t_warm:.2f} s)  x{t_full / t_warm:.1f}")
        print(f"  fast == full: cold {equal_cold:,}/{len(lines):,} lines, "
              f"warm {equal_warm:,}/{len(lines):,} lines")

        hf = hf_tokenizer(full.vocab, lower)
        if hf is not None:
            hf.encode_batch(lines[:1000], add_special_tokens=False)  # start its thread pool
            t_hf, encodings = timed(lambda: hf.encode_batch(lines, add_special_tokens=False))
            differ = sum(e.ids != ids for e, ids in zip(encodings, expected))
            print(f"  (HF tokenizers, 2 threads    {n_tokens / t_hf:>12,.0f} tokens/s  "
                  f"x{t_full / t_hf:.1f}; differs from Google on {differ:,} lines)")
    print(f"\nfast == full on every line with both vocabularies: {all_equal}")
    return all_equal


def bench_vocab(data_dir: Path) -> None:
    patterns = ",".join(str(data_dir / "corpus" / p) for p in VOCAB_CORPUS)
    for lower in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "vocab.txt")
            t_train, (stats, heldout) = timed(lambda: tv.train_vocab(
                patterns, 30522, out, do_lower_case=lower, heldout_every=20))
            unknown, total = tv.unk_rate(out, heldout, do_lower_case=lower)
        print(f"\ntrain_vocab --vocab_size=30522 --do_lower_case={lower} --heldout_every=20 "
              f"({t_train:.1f} s): {stats}")
        print(f"  held-out lines: {len(heldout):,}; [UNK] {unknown:,} / {total:,} tokens "
              f"= {100.0 * unknown / max(total, 1):.4f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--mode", choices=["all", "speed", "vocab"], default="all")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per path")
    args = parser.parse_args()
    if not (args.data_dir / "corpus").is_dir():
        print(f"{args.data_dir}/corpus is absent; nothing to benchmark.")
        return 0
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}")
    ok = True
    if args.mode in ("all", "speed"):
        ok = bench_speed(args.data_dir, args.repeats)
    if args.mode in ("all", "vocab"):
        bench_vocab(args.data_dir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

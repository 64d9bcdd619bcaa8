"""The HuggingFace side of `benchmarks.finetune.end_to_end`: the same fine-tuning run in transformers + PyTorch.

Run by `benchmarks.finetune.end_to_end --hf_python=PY` under a Python that has torch and transformers (it does
not import bert_jax or data_pipeline, so it can live in its own virtualenv):

    PY -m benchmarks.finetune.hf_reference --task=sst2 --model=MINILM_DIR --train=train.tsv \\
        --dev=dev.tsv --max_seq_length=64 --batch=32 --epochs=1 --lr=5e-5 --out=hf.json

The recipe is bert_jax's (and the paper's): AdamW (epsilon 1e-6, weight decay 0.01 off biases and
LayerNorm), linear warmup over 10% of the steps then linear decay to 0, global-norm clipping at
1.0, dropout 0.1, rows padded to `max_seq_length`, a fresh head on the pretrained encoder, the
training rows reshuffled every epoch. Tasks:

- `sst2`: GLUE SST-2 tsv (`sentence<TAB>label`), `BertForSequenceClassification`, dev accuracy.
- `conll2003`: CoNLL-2003 column files, `BertForTokenClassification` on each word's first piece
  (other pieces ignored), entity-level F1 by seqeval (conlleval's definition) on dev and test.

Writes one JSON object: the scores, wall seconds (all of it: loading, tokenizing, training,
evaluating), training seconds, and training sequences per second.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import time


def read_sst2(path):
    with open(path, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    header = rows[0]
    s, l = header.index("sentence"), header.index("label")
    return [(r[s], int(r[l])) for r in rows[1:]]


def read_conll(path):
    sentences, words, tags = [], [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if not parts or parts[0] == "-DOCSTART-":
                if words:
                    sentences.append((words, tags))
                words, tags = [], []
                continue
            words.append(parts[0])
            tags.append(parts[-1])
    if words:
        sentences.append((words, tags))
    return sentences


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=["sst2", "conll2003"], required=True)
    p.add_argument("--model", required=True, help="HF model folder (config.json, model.safetensors, vocab.txt)")
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--test", default="")
    p.add_argument("--do_lower_case", type=int, default=1)
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup_proportion", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--autocast_bf16", type=int, default=0,
                   help="1: the forward passes (training and evaluation) under torch.autocast('cpu', bfloat16), "
                        "PyTorch's CPU mixed precision (oneDNN bf16 matmuls; parameters, optimizer float32)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    started = time.time()
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tok = transformers.BertTokenizerFast(f"{args.model}/vocab.txt", do_lower_case=bool(args.do_lower_case))
    enc_kw = dict(max_length=args.max_seq_length, padding="max_length", truncation=True, return_tensors="pt")

    if args.task == "sst2":
        train, dev = read_sst2(args.train), read_sst2(args.dev)
        labels = None

        def encode(rows):
            e = tok([s for s, _ in rows], **enc_kw)
            return e, torch.tensor([y for _, y in rows])

        model = transformers.BertForSequenceClassification.from_pretrained(args.model, num_labels=2)
    else:
        train, dev = read_conll(args.train), read_conll(args.dev)
        labels = sorted({t for _, tags in train for t in tags})
        label_id = {t: i for i, t in enumerate(labels)}

        def encode(rows):
            e = tok([w for w, _ in rows], is_split_into_words=True, **enc_kw)
            y = torch.full(e["input_ids"].shape, -100, dtype=torch.long)
            for i, (_, tags) in enumerate(rows):
                previous = None
                for j, w in enumerate(e.word_ids(i)):
                    if w is not None and w != previous:
                        y[i, j] = label_id.get(tags[w], label_id["O"])
                    previous = w
            return e, y

        model = transformers.BertForTokenClassification.from_pretrained(args.model, num_labels=len(labels))

    train_enc, train_y = encode(train)
    n = len(train)
    steps_per_epoch = -(-n // args.batch)
    total = steps_per_epoch * args.epochs
    decay = [p for name, p in model.named_parameters() if not (name.endswith("bias") or "LayerNorm" in name)]
    no_decay = [p for name, p in model.named_parameters() if name.endswith("bias") or "LayerNorm" in name]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, eps=1e-6)
    sched = transformers.get_linear_schedule_with_warmup(opt, int(args.warmup_proportion * total), total)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.autocast_bf16))

    train_started = time.time()
    model.train()
    for epoch in range(args.epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + epoch))
        for b in range(steps_per_epoch):
            idx = order[b * args.batch:(b + 1) * args.batch]
            with autocast():  # the backward outside it, as PyTorch's autocast documentation says
                out = model(input_ids=train_enc["input_ids"][idx], attention_mask=train_enc["attention_mask"][idx],
                            token_type_ids=train_enc["token_type_ids"][idx], labels=train_y[idx])
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    train_seconds = time.time() - train_started

    model.eval()

    def predict(rows):
        enc, y = encode(rows)
        preds = []
        with torch.no_grad(), autocast():
            for b in range(0, len(rows), 128):
                sl = slice(b, b + 128)
                logits = model(input_ids=enc["input_ids"][sl], attention_mask=enc["attention_mask"][sl],
                               token_type_ids=enc["token_type_ids"][sl]).logits
                preds.append(logits.argmax(-1))
        return enc, y, torch.cat(preds)

    result = {"task": args.task, "train_examples": n, "epochs": args.epochs, "torch": torch.__version__,
              "autocast_bf16": bool(args.autocast_bf16),
              "transformers": transformers.__version__, "threads": torch.get_num_threads()}
    if args.task == "sst2":
        _, y, pred = predict(dev)
        result["dev_accuracy"] = float((pred == y).float().mean())
    else:
        from seqeval.metrics import f1_score

        for split, path in (("dev", args.dev), ("test", args.test)):
            if not path:
                continue
            rows = read_conll(path)
            enc, _, pred = predict(rows)
            gold, guess = [], []
            for i, (words, tags) in enumerate(rows):
                first = {}
                for j, w in enumerate(enc.word_ids(i)):
                    if w is not None and w not in first:
                        first[w] = int(pred[i, j])
                gold.append(tags)
                guess.append([labels[first[w]] if w in first else "O" for w in range(len(words))])
            result[f"{split}_f1"] = float(f1_score(gold, guess))
    result.update(wall_s=time.time() - started, train_s=train_seconds,
                  train_sequences_per_s=n * args.epochs / train_seconds)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

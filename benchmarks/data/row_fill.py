"""How full the pretraining rows are: real tokens per row, one record a row (as Google's recipe feeds
BERT) and packed (`config.packing`, as configs/modernbert_base.py feeds ModernBERT).

    python -m benchmarks.data.row_fill --records='DIR/*.tfrecord' --max_seq_length=1024 \\
        --max_predictions_per_seq=308 [--max_seqs_per_pack=3 --packing_window=512] [--json=OUT]

Reads the records once, in file order (Google's writer shuffles its instances), in windows of
`--packing_window`, parsed and packed by the training input's own functions (`parsing.parse_batch`,
`packing.pack_window`: first-fit-decreasing, at most `--max_seqs_per_pack` sequences a row). Every
row is counted: the training stream itself yields only the rows every host is sure to have in a
finite epoch. Prints, one record a row and packed, the rows, the real tokens (`input_mask`) and the
fill (real tokens / (rows x max_seq_length)), and how many times the real tokens of a padded row a
packed row carries. A training step's cost depends on its rows' shape, not on how many of their
positions are real, so a step-time ratio at full rows times this ratio is the ratio of real tokens
trained per second (benchmarks/step/RESULTS.md, "ModernBERT against BERT at equal parameters").
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from data_pipeline.input.packing import pack_window
from data_pipeline.input.parsing import parse_batch
from data_pipeline.tf_import import tf  # without Keras


def row_fill(records: str, *, max_seq_length: int, max_predictions_per_seq: int, max_seqs_per_pack: int = 3,
             packing_window: int = 512) -> dict:
    """`{"padded": ..., "packed": ...}`: rows, real tokens and fill of `records`, one record a row
    and packed window by window (module docstring)."""
    files = sorted(tf.io.gfile.glob(records))
    if not files:
        raise ValueError(f"{records}: no file matches")
    L, P = max_seq_length, max_predictions_per_seq
    counts = {"padded": [0, 0], "packed": [0, 0]}  # rows, real tokens
    for path in files:
        compression = "GZIP" if path.endswith(".gz") else ""
        for serialized in tf.data.TFRecordDataset(path, compression_type=compression).batch(packing_window):
            features = parse_batch(serialized, L, P)
            packed = pack_window(features, max_seq_length=L, max_seqs_per_pack=max_seqs_per_pack,
                                 max_predictions_per_pack=P * max_seqs_per_pack)
            for name, mask in (("padded", features["input_mask"]), ("packed", packed["input_mask"])):
                mask = np.asarray(mask)
                counts[name][0] += mask.shape[0]
                counts[name][1] += int(mask.sum())
    if not counts["padded"][0]:
        raise ValueError(f"{records}: no records")
    return {name: {"rows": rows, "real_tokens": real, "fill": real / (rows * L)}
            for name, (rows, real) in counts.items()}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", required=True, help="records glob (Google's schema, with their manifest)")
    p.add_argument("--max_seq_length", type=int, required=True)
    p.add_argument("--max_predictions_per_seq", type=int, required=True)
    p.add_argument("--max_seqs_per_pack", type=int, default=3)
    p.add_argument("--packing_window", type=int, default=512)
    p.add_argument("--json", default="", help="also write the result here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    shape = dict(max_seq_length=args.max_seq_length, max_predictions_per_seq=args.max_predictions_per_seq)
    fills = row_fill(args.records, max_seqs_per_pack=args.max_seqs_per_pack, packing_window=args.packing_window,
                     **shape)
    result = {"records": args.records, **shape, "max_seqs_per_pack": args.max_seqs_per_pack,
              "packing_window": args.packing_window, **fills,
              "packed_over_padded": fills["packed"]["fill"] / fills["padded"]["fill"]}
    for name in ("padded", "packed"):
        r = result[name]
        print(f"{name:>6}: {r['rows']:,} rows of {args.max_seq_length}, {r['real_tokens']:,} real tokens, "
              f"fill {100 * r['fill']:.1f}%")
    print(f"a packed row carries {result['packed_over_padded']:.3f}x the real tokens of a padded one")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

"""benchmarks/data/row_fill.py: the real tokens of padded and packed rows, on records of lengths chosen
here, against fills counted by hand (first-fit-decreasing worked through in the test's comment)."""

import pytest
import tensorflow as tf

from benchmarks.data import row_fill
from data_pipeline.records import manifests, schema
from tests.helpers import numbered_records as nr

LENGTHS = [32, 16, 20, 32, 10, 16, 6]  # rows of L = 32


def _records(tmp_path) -> str:
    path = str(tmp_path / "part-00000.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for rid, n in enumerate(LENGTHS):
            writer.write(schema.serialize(nr.make_record(rid, length=n)))
    manifests.write_dataset_info(str(tmp_path), {path: len(LENGTHS)})
    return str(tmp_path / "*.tfrecord")


def test_fills_of_padded_and_packed_rows_are_the_hand_counted_ones(tmp_path, capsys):
    real = sum(LENGTHS)  # 132
    # First-fit-decreasing, 3 sequences a row at most: 32 and 32 alone (not even the shortest, 6, fits
    # beside them); 20 opens a row; 16 opens a row (20 + 16 > 32); 16 joins it (32); 10 joins 20 (30);
    # 6 fits no row (30 + 6, 32 + 6) and opens one. Five rows.
    result = row_fill.main(["--records", _records(tmp_path), "--max_seq_length", str(nr.L),
                            "--max_predictions_per_seq", str(nr.P)])
    assert result["padded"] == {"rows": 7, "real_tokens": real, "fill": pytest.approx(real / (7 * 32))}
    assert result["packed"] == {"rows": 5, "real_tokens": real, "fill": pytest.approx(real / (5 * 32))}
    assert result["packed_over_padded"] == pytest.approx(7 / 5)
    assert "fill 82.5%" in capsys.readouterr().out

"""SQuAD's sliding context windows, as google-research/bert `run_squad.py` cuts and scores them."""

from __future__ import annotations


def doc_windows(num_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """Google's sliding windows `(start, length)`: the last one ends at the document's end.

    Example: 10 pieces, windows of 4, stride 3 -> (0, 4), (3, 4), (6, 4).
    """
    windows, start = [], 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens)
        windows.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, stride)
    return windows or [(0, 0)]


def is_max_context(windows: list[tuple[int, int]], current_start: int, position: int) -> bool:
    """Whether the window starting at `current_start` gives `position` its most context.

    Score of a window for a token: min(left context, right context) + 0.01 * window length;
    the first best window wins (Google's `_check_is_max_context`).
    """
    best_score, best_start = None, None
    for start, length in windows:
        end = start + length - 1
        if position < start or position > end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best_score is None or score > best_score:
            best_score, best_start = score, start
    return best_start == current_start

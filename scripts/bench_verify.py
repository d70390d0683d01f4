"""Time the per-token shard checks: the numba one-pass kernel vs the numpy passes it replaced.

    python scripts/bench_verify.py --tokens 200000000

Builds flat input_ids / labels / position_ids (int32) and seq_lens (int64) of a valid shard in RAM
(random example lengths up to --max-example, about half the labels masked), then times, on the same
arrays, `pipeline.verify._token_checks` (after one warm-up call for the JIT) and `numpy_token_checks`
below, a copy of the vectorised checks `check_shard` ran before (negative ids, ids >= vocab,
position_ids per example, label -100 at every example start, every other label -100 or the input id,
loss-token count). Both must agree that the shard is valid and on the loss-token count.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from pipeline.shards import IGNORE_INDEX
from pipeline.verify import _token_checks


def numpy_token_checks(ids: np.ndarray, labels: np.ndarray, pos: np.ndarray, seq: np.ndarray,
                       vocab: int) -> tuple[bool, int]:
    """The former numpy version: (any defect, loss tokens)."""
    cum = np.concatenate(([0], np.cumsum(seq)))
    starts = cum[:-1]
    n_tok = int(cum[-1])
    bad = bool((ids < 0).any())
    bad |= bool(vocab and (ids >= vocab).any())
    expected = np.arange(n_tok, dtype=np.int64) - np.repeat(starts, seq)
    bad |= bool((pos != expected).any())
    del expected
    bad |= bool(len(starts) and (labels[starts] != IGNORE_INDEX).any())
    bad |= bool(((labels != IGNORE_INDEX) & (labels != ids)).any())
    loss = int(np.count_nonzero(labels != IGNORE_INDEX))
    return bad, loss


def make_shard(tokens: int, max_example: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Flat columns of a valid shard of exactly `tokens` tokens."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(1, max_example + 1, size=int(tokens / ((max_example + 1) / 2) * 1.2) + 16).astype(np.int64)
    cum = np.cumsum(seq)
    n = int(np.searchsorted(cum, tokens))
    seq = seq[: n + 1].copy()
    seq[-1] -= int(cum[n]) - tokens
    if seq[-1] == 0:
        seq = seq[:-1]
    ids = rng.integers(0, vocab, size=tokens, dtype=np.int32)
    labels = np.where(rng.random(tokens, dtype=np.float32) < 0.5, IGNORE_INDEX, ids).astype(np.int32)
    starts = np.concatenate(([0], np.cumsum(seq)[:-1]))
    labels[starts] = IGNORE_INDEX
    pos = (np.arange(tokens, dtype=np.int64) - np.repeat(starts, seq)).astype(np.int32)
    return ids, labels, pos, seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200_000_000)
    parser.add_argument("--max-example", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=2, help="best of this many timings each")
    args = parser.parse_args()
    ids, labels, pos, seq = make_shard(args.tokens, args.max_example, args.vocab)
    print(f"{args.tokens} tokens, {len(seq)} examples; {platform.processor() or platform.machine()}, "
          f"{__import__('os').cpu_count()} CPUs")
    _token_checks(ids[:10], labels[:10], pos[:10], np.array([10], np.int64), args.vocab)  # JIT / cache load
    best = {"numba": float("inf"), "numpy": float("inf")}
    for _ in range(args.repeat):
        t = time.perf_counter()
        code, at, loss_nb, _ = _token_checks(ids, labels, pos, seq, args.vocab)
        best["numba"] = min(best["numba"], time.perf_counter() - t)
        t = time.perf_counter()
        bad, loss_np = numpy_token_checks(ids, labels, pos, seq, args.vocab)
        best["numpy"] = min(best["numpy"], time.perf_counter() - t)
        assert code == 0 and not bad and loss_nb == loss_np, (code, at, bad, loss_nb, loss_np)
    for name, sec in best.items():
        print(f"{name:6s} {sec:7.3f} s  {args.tokens / sec / 1e6:8.1f} M tokens/s")
    print(f"numba is {best['numpy'] / best['numba']:.1f}x faster than numpy (loss tokens {loss_nb})")


if __name__ == "__main__":
    main()

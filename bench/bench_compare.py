"""Cost of numalign's full metric set against torch.testing.assert_close.

Both run on the same pair of 16M-element float32 tensors (a candidate within tolerance of
its truth), single-threaded, in one process; the best of several repeats of each is taken,
and the ratio is printed. Target: 2.0x or less.

    python bench/bench_compare.py [--numel N] [--repeats R]
"""

from __future__ import annotations

import argparse

import torch
from timing import best_of

import numalign


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(args.numel, generator=gen)
    actual = expected + 1e-6 * torch.randn(args.numel, generator=gen)
    tolerance = numalign.Tolerance(rtol=1e-4, atol=1e-4)

    def full_metrics() -> None:
        result = numalign.compare(actual, expected, numalign.CompareSpec(tolerance=tolerance))
        assert result.passed, result.message()

    def assert_close() -> None:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)

    # Interleave warm-up so that neither side pays first-touch costs alone.
    full_metrics()
    assert_close()
    t_ref = best_of(assert_close, args.repeats)
    t_full = best_of(full_metrics, args.repeats)
    print(f"elements:                 {args.numel}")
    print(f"torch.testing.assert_close {t_ref * 1e3:9.1f} ms")
    print(f"numalign.compare (full)    {t_full * 1e3:9.1f} ms")
    print(f"ratio full/assert_close    {t_full / t_ref:9.2f}x   (target <= 2.0x)")


if __name__ == "__main__":
    main()

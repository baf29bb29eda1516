"""This machine's figures the benchmarks print beside theirs: memory read bandwidth."""

from __future__ import annotations

import statistics
import time

import torch


def read_bandwidth_gbs(megabytes: int = 1024, repeats: int = 7) -> float:
    """GB/s at which all of torch's threads read a buffer far larger than the caches (a sum over
    float32 values: one add per 4 bytes, far below what the cores can do, so memory bounds it);
    the median of `repeats` passes after one warm-up."""
    values = torch.ones(megabytes * 1024 * 1024 // 4)
    values.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        values.sum()
        times.append(time.perf_counter() - start)
    return values.numel() * 4 / statistics.median(times) / 1e9


if __name__ == "__main__":
    print(f"read bandwidth: {read_bandwidth_gbs():.1f} GB/s ({torch.get_num_threads()} threads)")

"""A process that fills a compile cache with a fake compiler (for the multi-process cache tests).

    python -m tests.cache_worker ROOT LOG SECONDS_PER_PROGRAM [REMOTE_URL]

Prints one JSON line: program name -> source. The fake compiler appends "NAME PID" to LOG per
program it builds, so a test can count how often each program was compiled across processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tests.helpers import TINY_CACHE_CONFIG, tiny_arch
from vllm_aot.cache.program_cache import CacheSettings, ProgramCache


def fake_compile(log: Path, seconds: float):
    def compile_fn(jobs, on_done) -> None:
        for key, path in jobs:
            time.sleep(seconds)
            path.write_bytes(f"{key.name} built by {os.getpid()}".encode())
            with open(log, "a") as handle:
                handle.write(f"{key.name} {os.getpid()}\n")
            on_done(key, seconds)

    return compile_fn


def main(root: str, log: str, seconds: str, remote: str | None = None) -> None:
    cache = ProgramCache(CacheSettings(root=Path(root), remote_url=remote, lock_timeout=120))
    outcome = cache.ensure(
        tiny_arch(), TINY_CACHE_CONFIG, compile_fn=fake_compile(Path(log), float(seconds))
    )
    print(json.dumps(outcome.sources), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Peak RSS measured from outside: one child process per variant, so no variant's memory
(or the test runner's) hides another's. The child prints two integers on its last line: a
parameter count and its ``ru_maxrss`` growth in KiB over the part it measures."""

from __future__ import annotations

import os
import subprocess
import sys


def peak_rss_growth(child_code: str, variants: tuple[str, ...]) -> tuple[int, dict[str, int]]:
    """Runs ``child_code`` once per variant (passed as ``sys.argv[1]``); returns the count the
    children printed and each variant's peak-RSS growth in bytes."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    growth, count = {}, 0
    for variant in variants:
        out = subprocess.run([sys.executable, "-c", child_code, variant], capture_output=True, text=True, env=env,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        count, kib = map(int, out.stdout.split()[-2:])
        growth[variant] = kib * 1024
    return count, growth


def saved_bytes_per_unit(child_code: str, baseline: str, variant: str, what: str) -> tuple[int, float]:
    """Peak-RSS growth of ``baseline`` minus ``variant``'s, per unit of the children's count
    (printed, for the log); returns (count, bytes saved per unit)."""
    count, growth = peak_rss_growth(child_code, (baseline, variant))
    saved = (growth[baseline] - growth[variant]) / count
    print(f"peak RSS growth, {count / 1e6:.1f} M {what}: {baseline} {growth[baseline] / 2**20:.0f} MiB, {variant} "
          f"{growth[variant] / 2**20:.0f} MiB, saved {saved:.2f} B each")
    return count, saved

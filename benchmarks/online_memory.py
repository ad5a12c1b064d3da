"""Memory of `OnlineMetrics` over a long replay: it must stay flat once the feedback window is full.

Replays N events (query-log requests of a Zipf-distributed user population, and the feedback on
them, over a day of event time) through `OnlineMetrics.apply`, the function `poll` calls for each
record read from Kafka, and measures the process's resident memory (after a garbage collection) at
checkpoints. The state is bounded by the users of the rollout (the population) and the feedback
window (`--window-s` of event time), so it grows while users first appear and the window fills,
then stays flat: the ratio compares the end with the middle of the replay.

    python benchmarks/online_memory.py [--events 1000000] [--users 20000] [--window-s 3600]

The last line is `ratio: X.XX` (resident memory at the end / at half of the replay; flat is ~1).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.online import OnlineMetrics  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--users", type=int, default=20_000)
    ap.add_argument("--window-s", type=float, default=3600.0)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    share = np.arange(1, args.users + 1, dtype=float) ** -1.1
    requests = int(args.events / 1.6)  # each request gets ~0.6 feedback events
    users = np.searchsorted(np.cumsum(share) / share.sum(), rng.random(requests))
    arms = np.where(rng.random(args.users) < 0.5, "canary", "stable")
    ts = np.linspace(0.0, 86_400.0, requests)
    m = OnlineMetrics("unused:9092", "q", "f", feedback_window_s=args.window_s)
    m.track("ro-bench", 0, 0.0)

    def rss() -> int:
        gc.collect()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    marks = {int(args.events * f) for f in (0.1, 0.25, 0.5, 0.75, 1.0)}
    heap: dict[int, int] = {}
    n = 0
    started = time.perf_counter()
    for i in range(requests):
        u = int(users[i])
        m.apply(
            "q",
            json.dumps(
                {
                    "request_id": f"r{i}",
                    "user_key": f"u{u}",
                    "experiment_id": "ro-bench",
                    "assigned_variant": arms[u],
                    "variant": arms[u],
                    "ts": float(ts[i]),
                    "latency_ms": float(rng.lognormal(6.0, 0.5)),
                }
            ).encode(),
        )
        n += 1
        if i % 5 < 3:
            m.apply("f", json.dumps({"request_id": f"r{i}", "kind": "thumbs_up" if i % 2 else "thumbs_down"}).encode())
            n += 1
        if i % 1000 == 0 and any(n >= k for k in marks - heap.keys()):
            heap[min(k for k in marks - heap.keys() if n >= k)] = rss()
    heap.setdefault(max(marks), rss())
    elapsed = time.perf_counter() - started
    for k in sorted(heap):
        print(f"{k:>9} events: {heap[k] / 2**20:7.1f} MiB resident")
    print(
        f"{n} events in {elapsed:.0f} s; users {sum(len(a.users) for a in m.arms.values())}, "
        f"window {len(m.window)} requests"
    )
    print(f"ratio: {heap[max(heap)] / heap[min(k for k in heap if k >= args.events * 0.5)]:.2f}")


if __name__ == "__main__":
    main()

"""Publishing a policy step: every trainer's state written again, against the unchanged one linked (issue 38).

A round publishes each step as one atomic directory (train/rounds.py `publish_step`): the weights any engine can load
and the AdamW state of the policy, and of the rubric generator in two-model mode (the demo's), each file fsynced
before the rename. A policy step leaves the generator as it was, so `Trainers.save` now hard-links the generator's
files from the last published step instead of writing them again.

Both arms run the loop's own `Trainers` (the demo profile, SmolLM2-135M as policy and generator) and publish through
the loop's `atomic.directory`, alternately, after one real policy update each (a GRPO step on 4 short answers):

    write   `Trainers.save(tmp)` with no previous step: both trainers written (what every step did before)
    link    `Trainers.save(tmp, previous)`: the policy written, the generator linked from the last published step

It prints each publish's seconds, the medians and `ratio: X` (link / write).

    python benchmarks/step_publish.py [--reps 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout this file is in, not another install

from dynrubric import atomic, modelcache  # noqa: E402
from dynrubric.config_loader import load_settings  # noqa: E402
from dynrubric.train.executor import Trainers, TrainerSpec  # noqa: E402
from dynrubric.train.grpo import CandidateSet, SampledResponse  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="publishes per arm")
    ap.add_argument("--dir", type=Path, default=None, help="where the steps are published (default: a temp dir)")
    args = ap.parse_args()

    settings = load_settings(environ={}, profile="demo")
    model = modelcache.resolve(settings.paths.resolved_home(), settings.models.policy)
    trainers = Trainers(TrainerSpec(settings, model, model, model, None))
    assert not trainers.single, "the demo profile trains the generator as its own model"
    prompt = tuple(range(100, 140))
    groups = [
        CandidateSet(
            tuple(SampledResponse(prompt, tuple(range(200 + 10 * i, 232 + 10 * i))) for i in range(4)),
            (1.0, 0.0, 0.5, 0.25),
        )
    ]
    root = Path(tempfile.mkdtemp(prefix="step-publish-", dir=args.dir))
    seconds: dict[str, list[float]] = {"write": [], "link": []}
    previous: Path | None = None
    try:
        for step in range(2 * args.reps):
            arm = ("write", "link")[step % 2]
            stats = trainers.step("policy", groups)
            assert stats["updated"], stats
            target = root / f"{step:04d}"
            start = time.perf_counter()
            with atomic.directory(target) as tmp:
                trainers.save(tmp, previous if arm == "link" else None)
            seconds[arm].append(time.perf_counter() - start)
            print(f"step {step} {arm}: {seconds[arm][-1]:.2f} s", flush=True)
            if previous is not None:
                shutil.rmtree(previous)  # as publish_step: the older step goes once the new one is published
            previous = target
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write, link = statistics.median(seconds["write"]), statistics.median(seconds["link"])
    print(f"write: median {write:.2f} s over {args.reps} publishes (both trainers written)")
    print(f"link: median {link:.2f} s over {args.reps} publishes (the policy written, the generator linked)")
    print(f"ratio: {link / write:.2f}")


if __name__ == "__main__":
    main()

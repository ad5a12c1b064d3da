"""A 4 x 4 OpenRLHF batch against one `dynrubric serve-reward`, through OpenRLHF 0.11.2's own client
(`SingleTurnAgentExecutor`, 180 s request timeout, one request per sample, all at once), with the default
rubric settings and SmolLM2-135M in process: is every request answered inside the client's timeout?

Runs the batch twice, side by side: `reward_server.batch_linger_s=0` (the baseline: groups are judged
as they close, one after another) and the configured linger (groups closing together are one batch).
Prints wall time, OpenRLHF's retries and cancelled requests per run, and `ratio: X` (linger / baseline).

    python benchmarks/reward_openrlhf_batch.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from reward_group import QUESTIONS, RESPONSES  # noqa: E402

from dynrubric import modelcache  # noqa: E402
from dynrubric.config_loader import load_settings  # noqa: E402
from tests.reward_servers import TOKEN, openrlhf_rollout, reward_replicas  # noqa: E402


def one_batch(tokenizer, prompts: list[str], linger: str | None, tmp: Path) -> tuple[float, float, float]:
    env = {"DYNRUBRIC_ENGINE__THREADS": "0"}
    if linger is not None:
        env["DYNRUBRIC_REWARD_SERVER__BATCH_LINGER_S"] = linger
    with reward_replicas(1, env, tmp) as [server]:
        start = time.monotonic()
        openrlhf_rollout([f"{server.url}/get_reward?token={TOKEN}"], tokenizer, prompts, RESPONSES)
        wall = time.monotonic() - start
        return (
            wall,
            server.metric("dynrubric_reward_retried_samples_total"),
            server.metric("dynrubric_reward_cancelled_requests_total"),
        )


def main() -> None:
    import tempfile

    from transformers import AutoTokenizer

    model = modelcache.resolve(load_settings().paths.resolved_home(), "smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [
        cast(
            str,
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
        )
        for q in QUESTIONS
    ]  # tokenize=False: the rendered text
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, linger in (("baseline (linger 0)", "0"), ("configured linger", None)):
            runs[name] = one_batch(tokenizer, prompts, linger, Path(tmp))
            wall, retried, cancelled = runs[name]
            print(
                f"{name}: 4x4 batch answered in {wall:.1f} s (client timeout 180 s); retried {retried:.0f}, "
                f"cancelled {cancelled:.0f}",
                flush=True,
            )
    print(f"ratio: {runs['configured linger'][0] / runs['baseline (linger 0)'][0]:.2f}")


if __name__ == "__main__":
    main()

"""Trainer memory: the sampled tokens' log-probs through the full B x T x V log_softmax vs chunked.

A synthetic LM head (a bias-free Linear from `--hidden` to `--vocab`, 152,064 = Qwen2's vocabulary) over
`--tokens` response tokens at temperature 0.7. Both paths compute the per-token log-probs and the
gradient of a token-mean loss over them (random advantages) with respect to the hidden states and the
head's weight:

- full: the trainer's path before chunking, `log_softmax(head(h).float() / T).gather(y)` over every token
  at once (float32 logits, the tempered copy and the log-softmax of B x T x V are all alive at once);
- chunked: `dynrubric.train.grpo.token_logprobs`, `grpo.logprob_chunk_mib` MiB of logits at a time, each
  chunk checkpointed (its backward recomputes its logits).

Each path runs in a fresh process; its peak is the peak resident memory above what the process held
just before the forward (the head, its inputs), reset through /proc/self/clear_refs, so the head's
weight gradient (V x d, the same on both sides) is in both numbers.

    python benchmarks/logprob_memory.py [--quick] [--tokens N] [--hidden D] [--vocab V] [--chunk-mib M]

The last lines are `max |diff|: ...` (log-probs and gradients, target <= 1e-5) and `ratio: X.XX`
(chunked peak / full peak; target <= 0.25).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEMPERATURE = 0.7


def status_kib(field: str) -> int:
    found = re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert found is not None, f"no {field} in /proc/self/status"
    return int(found.group(1))


def worker(path: str, tokens: int, hidden: int, vocab: int, chunk_mib: int, out: Path) -> dict:
    """One path's forward and backward in this (fresh) process: peak memory above the start, seconds,
    and the log-probs and gradients saved to `out` for the comparison."""
    import torch

    from dynrubric.train.grpo import chunk_rows, token_logprobs

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * hidden**-0.5)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    # the loss's per-token coefficients: advantages over the token count, the trainer's token-mean loss
    weights = torch.randn(tokens, generator=g) / tokens
    temps = torch.full((tokens,), TEMPERATURE)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    start_kib = status_kib("VmRSS")
    t0 = time.perf_counter()
    if path == "full":
        logp = torch.log_softmax(head(h).float() / TEMPERATURE, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    else:
        logp = token_logprobs(head, h, targets, temps, chunk_rows(vocab, chunk_mib))
    (weights * logp).sum().backward()
    seconds = time.perf_counter() - t0
    peak = (status_kib("VmHWM") - start_kib) * 1024
    torch.save({"logp": logp.detach(), "grad_h": h.grad, "grad_w": head.weight.grad}, out)
    return {"peak_bytes": peak, "seconds": seconds}


def run(path: str, args: argparse.Namespace, out: Path) -> dict:
    job = {
        "path": path,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "chunk_mib": args.chunk_mib,
        "out": str(out),
    }
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the {path} path failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from dynrubric.config import GRPOConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens (CI)")
    ap.add_argument("--tokens", type=int, default=None, help="response tokens, B x T (default 2048; 512 --quick)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the synthetic head")
    ap.add_argument("--vocab", type=int, default=152_064, help="vocabulary (Qwen2's by default)")
    ap.add_argument("--chunk-mib", type=int, default=GRPOConfig().logprob_chunk_mib, help="grpo.logprob_chunk_mib")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: JSON job of one path
    args = ap.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(
            json.dumps(
                worker(job["path"], job["tokens"], job["hidden"], job["vocab"], job["chunk_mib"], Path(job["out"]))
            )
        )
        return
    args.tokens = args.tokens or (512 if args.quick else 2048)

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        results = {p: run(p, args, Path(tmp) / f"{p}.pt") for p in ("full", "chunked")}
        full, chunked = (torch.load(Path(tmp) / f"{p}.pt") for p in ("full", "chunked"))
    diffs = {k: float((full[k] - chunked[k]).abs().max()) for k in ("logp", "grad_h", "grad_w")}
    logits_gib = args.tokens * args.vocab * 4 / 2**30
    print(
        f"synthetic head: {args.tokens} tokens x hidden {args.hidden} -> vocabulary {args.vocab} "
        f"(one float32 logits tensor: {logits_gib:.2f} GiB), temperature {TEMPERATURE}, "
        f"chunks of {args.chunk_mib} MiB, torch threads {torch.get_num_threads()}"
    )
    print(f"{'path':34}{'peak MiB':>10}{'seconds':>9}")
    for name, label in (("full", "full log_softmax (before)"), ("chunked", "chunked token_logprobs")):
        print(f"{label:34}{results[name]['peak_bytes'] / 2**20:>10.0f}{results[name]['seconds']:>9.2f}")
    print("max |diff|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    print(f"ratio: {results['chunked']['peak_bytes'] / results['full']['peak_bytes']:.3f}")


if __name__ == "__main__":
    main()

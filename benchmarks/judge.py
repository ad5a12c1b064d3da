"""Judging cost, side by side: batched shared-prefix logprob verdicts vs unshared batching vs naive judging.

Same engine (in-process TransformersEngine), same candidate sets (K responses), same rubric (M items):

- batched:  the evaluator's path. All M*K verifier prompts of a set in ONE `score_next_token` call,
            laid out [instructions, question, response] + [item], so each response is encoded once.
- unshared: the same prompts in the same batched call with prefix reuse switched off: every prompt is
            run in full.
- naive:    a judge that writes its answer: one greedy `generate` per (item, response), prompt prefill
            plus the written tokens, one after another.
- limit:    the physical limit: per set, ONE forward pass over exactly its unique tokens (below) as a
            single unpadded sequence, same engine, same threads.

"tokens" is what the engine actually ran through the model (`TransformersEngine.tokens_processed`);
"unique" is the number of distinct prompt-token prefixes of a set (the nodes of its token trie: the
shared instructions once, each question and response once, each item tail once): the least any exact
method must compute. Rubric generation is timed too, on the same sets, sampled freely and under a
rubric JSON Schema (xgrammar, `SamplingParams.json_schema`), same prompts and token budget.

The last lines are `token ratio: X.XX` (batched tokens / unique tokens), `speedup: X.XX` (naive time /
batched time), `limit ratio: X.XX` (batched time / limit time; target <= 1.3) and
`generation tokens/s: X without grammar, Y with grammar`.

    python benchmarks/judge.py --quick
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this file is in, not another install

from dynrubric.engines.base import GenerationRequest, SamplingParams
from dynrubric.engines.hf import TransformersEngine
from dynrubric.rubric.generate import rubric_schema
from dynrubric.rubric.items import Rubric, RubricItem
from dynrubric.rubric.verify import Verifier, hard_verdict

QUESTIONS = [
    "What is 17 + 25? Explain briefly.",
    "Why do leaves change colour in autumn?",
    "Write a two-line poem about rain.",
    "How do I reverse a list in Python?",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give two tips for sleeping better.",
    "What causes the seasons on Earth?",
    "Summarise what a hash table is in one paragraph.",
]
OPENINGS = [
    "Sure.",
    "Good question!",
    "Here is the answer.",
    "Let me explain.",
    "Short answer:",
    "Well,",
    "In brief:",
    "OK.",
]
BODY = (
    "The key idea is that {topic} follows from a few simple facts. First, consider what is being asked and "
    "what a careful reader would expect. Second, check each step against what is known. Third, state the "
    "result plainly. In this case the answer depends on {topic}, and I will keep it short."
)
RUBRIC = Rubric(
    items=[
        RubricItem(id="answers", text="The response directly answers the question.", weight=5, polarity=1),
        RubricItem(id="correct", text="The response is factually correct.", weight=5, polarity=1),
        RubricItem(id="explains", text="The response gives a reason or explanation.", weight=3, polarity=1),
        RubricItem(id="concise", text="The response is concise and stays on topic.", weight=2, polarity=1),
        RubricItem(id="hedges", text="The response hedges or refuses instead of answering.", weight=3, polarity=-1),
        RubricItem(id="filler", text="The response contains filler or repeated text.", weight=2, polarity=-1),
    ]
)

# what constrained rubric generation is timed under: the generator's own schema
RUBRIC_SCHEMA = rubric_schema()


def candidate_sets(n_sets: int, k: int) -> list[tuple[str, list[str]]]:
    """Deterministic sets of K responses of different lengths (about 20 to 90 tokens)."""
    sets = []
    for s in range(n_sets):
        question = QUESTIONS[s % len(QUESTIONS)]
        topic = question.split("?")[0].lower()
        responses = []
        for j in range(k):
            body = BODY.format(topic=topic)
            words = body.split()
            cut = words[: 12 + (j * 47 + s * 13) % len(words)]
            responses.append(f"{OPENINGS[(j + s) % len(OPENINGS)]} {' '.join(cut)}")
        sets.append((question, responses))
    return sets


def trie_tokens(engine: TransformersEngine, prompts: list[str]) -> list[int]:
    """The nodes of the prompts' token trie (each distinct token prefix once), in first-seen order:
    shared instructions once, each question and response once, each item tail once."""
    root: dict[int, dict] = {}
    nodes: list[int] = []
    for p in prompts:
        node = root
        for t in engine.encode(p):
            if t not in node:
                node[t] = {}
                nodes.append(t)
            node = node[t]
    return nodes


def run_logprob(engine: TransformersEngine, verifier: Verifier, sets, share: bool) -> tuple[int, float, list]:
    engine.share_prefix = share
    start_tokens, start = engine.tokens_processed, time.perf_counter()
    verdicts = [verifier.verify(q, responses, RUBRIC)[0] for q, responses in sets]
    return engine.tokens_processed - start_tokens, time.perf_counter() - start, verdicts


@torch.no_grad()
def run_limit(engine: TransformersEngine, sets_tokens: list[list[int]]) -> float:
    """One forward pass per set over exactly its unique tokens, as a single unpadded sequence.

    No method that computes every distinct prefix can do less model work; a single causal sequence
    even attends wider than the trie (each node only needs its ancestors), so this bounds from above.
    """
    start = time.perf_counter()
    for tokens in sets_tokens:
        engine.model(input_ids=torch.tensor([tokens]), use_cache=False, logits_to_keep=1)
    return time.perf_counter() - start


def generation_prompt(engine: TransformersEngine, question: str, responses: list[str]) -> str:
    shown = "\n\n".join(f"[Candidate {n}]\n{r}" for n, r in enumerate(responses, 1))
    user = (
        f"Write a grading rubric as JSON that tells the better candidates from the worse ones.\n\n"
        f"Question:\n{question}\n\n{shown}"
    )
    return engine.render_chat([{"role": "user", "content": user}])


def run_generation(
    engine: TransformersEngine, sets, samples: int, max_tokens: int, schema: str | None
) -> tuple[int, float, int, int]:
    """(generated tokens, seconds, outputs valid for RUBRIC_SCHEMA, outputs that ended by themselves)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.7, n=samples, seed=0, json_schema=schema)
    requests = [GenerationRequest(generation_prompt(engine, q, r), params) for q, r in sets]
    start = time.perf_counter()
    outs = [c for completions in engine.generate(requests) for c in completions]
    seconds = time.perf_counter() - start

    def valid(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), RUBRIC_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return (
        sum(len(c.token_ids) for c in outs),
        seconds,
        sum(valid(c.text) for c in outs),
        sum(c.finish_reason == "stop" for c in outs),
    )


def run_naive(engine: TransformersEngine, verifier: Verifier, sets, max_tokens: int) -> tuple[int, float, list]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    start_tokens, start = engine.tokens_processed, time.perf_counter()
    verdicts = []
    for q, responses in sets:
        prompts = verifier.prompts(q, responses, RUBRIC)  # response-major: k*M + m
        answers = [hard_verdict(engine.generate([GenerationRequest(p, greedy)])[0][0].text) for p in prompts]
        m = len(RUBRIC.items)
        verdicts.append([[answers[k * m + i] for k in range(len(responses))] for i in range(m)])
    return engine.tokens_processed - start_tokens, time.perf_counter() - start, verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model-cache name or HF directory")
    ap.add_argument("--quick", action="store_true", help="1 set instead of 8")
    ap.add_argument("--sets", type=int, default=None)
    ap.add_argument("--k", type=int, default=8, help="responses per set")
    ap.add_argument("--naive-max-tokens", type=int, default=16, help="tokens the naive judge writes at most")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of the batched judge and its limit (best kept)")
    ap.add_argument("--gen-samples", type=int, default=4, help="rubrics sampled per set in the generation timing")
    ap.add_argument("--gen-max-tokens", type=int, default=256, help="token budget of a sampled rubric")
    args = ap.parse_args()

    from dynrubric import modelcache
    from dynrubric.config_loader import load_settings

    model_dir = (
        Path(args.model)
        if Path(args.model).is_dir()
        else modelcache.resolve(load_settings().paths.resolved_home(), args.model)
    )
    n_sets = args.sets or (1 if args.quick else 8)
    engine = TransformersEngine(model_dir, threads=args.threads)
    verifier = Verifier(engine)
    sets = candidate_sets(n_sets, args.k)
    m = len(RUBRIC.items)
    verifier.verify(sets[0][0], sets[0][1][:1], RUBRIC)  # warm-up: allocator, kernels
    set_tokens = [trie_tokens(engine, verifier.prompts(q, r, RUBRIC)) for q, r in sets]
    unique = sum(len(t) for t in set_tokens)

    print(
        f"machine: {platform.node()} {platform.machine()}, torch threads {torch.get_num_threads()}; "
        f"model {model_dir.name}; {n_sets} sets x K={args.k} responses x M={m} items = {n_sets * m * args.k} verdicts"
    )
    print(f"unique prompt tokens: {unique}")
    print(f"{'method':<10} {'tokens':>9} {'tok/unique':>10} {'seconds':>9} {'verdicts/s':>10}", flush=True)
    pairs = n_sets * m * args.k

    def row(name: str, tok: int, sec: float) -> None:
        print(f"{name:<10} {tok:>9} {tok / unique:>10.2f} {sec:>9.2f} {pairs / sec:>10.1f}", flush=True)

    # the batched judge and its limit alternate, best of --repeats each: a busy machine slows single runs
    batched_s = limit_s = float("inf")
    for _ in range(args.repeats):
        batched_tok, seconds, batched_v = run_logprob(engine, verifier, sets, share=True)
        batched_s = min(batched_s, seconds)
        limit_s = min(limit_s, run_limit(engine, set_tokens))
    row("batched", batched_tok, batched_s)
    row("limit", unique, limit_s)
    unshared_tok, unshared_s, unshared_v = run_logprob(engine, verifier, sets, share=False)
    row("unshared", unshared_tok, unshared_s)
    engine.share_prefix = True
    naive_tok, naive_s, naive_v = run_naive(engine, verifier, sets, args.naive_max_tokens)
    row("naive", naive_tok, naive_s)

    max_diff = max(
        abs(a - b)
        for s1, s2 in zip(batched_v, unshared_v, strict=True)
        for r1, r2 in zip(s1, s2, strict=True)
        for a, b in zip(r1, r2, strict=True)
    )
    agree = (
        sum(
            (a >= 0.5) == (b >= 0.5)
            for s1, s2 in zip(batched_v, naive_v, strict=True)
            for r1, r2 in zip(s1, s2, strict=True)
            for a, b in zip(r1, r2, strict=True)
        )
        / pairs
    )
    print(
        f"unshared/batched: tokens {unshared_tok / batched_tok:.2f}x, time {unshared_s / batched_s:.2f}x; "
        f"naive/batched: tokens {naive_tok / batched_tok:.2f}x"
    )
    print(
        f"batched vs unshared max |v| difference: {max_diff:.2e}; "
        f"batched (v>=0.5) agrees with naive's written answer on {agree:.0%}"
    )

    schema = json.dumps(RUBRIC_SCHEMA)
    start = time.perf_counter()
    engine.grammars().compiled(schema)
    print(f"rubric schema compiled in {time.perf_counter() - start:.2f} s (once per engine)")
    gen = {}
    for name, constraint in (("free", None), ("json schema", schema)):
        tokens, seconds, n_valid, n_done = run_generation(
            engine, sets, args.gen_samples, args.gen_max_tokens, constraint
        )
        gen[name] = tokens / seconds
        print(
            f"generation {name:<11}: {tokens} tokens in {seconds:.2f} s; {n_valid}/{len(sets) * args.gen_samples} "
            f"valid rubric JSON, {n_done} finished within {args.gen_max_tokens} tokens",
            flush=True,
        )

    print(f"token ratio: {batched_tok / unique:.2f}")
    print(f"speedup: {naive_s / batched_s:.2f}")
    print(f"limit ratio: {batched_s / limit_s:.2f}")
    print(f"generation tokens/s: {gen['free']:.1f} without grammar, {gen['json schema']:.1f} with grammar")


if __name__ == "__main__":
    main()

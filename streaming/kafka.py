"""Plain Kafka-protocol plumbing shared by producer and ingest: connection settings, topic creation.

Nothing here knows about Tansu: pointing `kafka.bootstrap_servers` (and the SASL/TLS keys) at a real
Kafka cluster is all it takes to move off the embedded broker.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Any

from dynrubric.config import KafkaConfig
from dynrubric.errors import DynrubricError
from streaming.events import DEAD_LETTER_TOPIC, FEEDBACK_TOPIC, QUERY_LOG_TOPIC


@dataclass(frozen=True)
class Topics:
    """The three topic names as configured (`kafka.topic_prefix` + the standard names)."""

    query_log: str
    feedback: str
    dead_letter: str

    @classmethod
    def of(cls, kafka: KafkaConfig) -> Topics:
        p = kafka.topic_prefix
        return cls(p + QUERY_LOG_TOPIC, p + FEEDBACK_TOPIC, p + DEAD_LETTER_TOPIC)

    def all(self) -> tuple[str, ...]:
        return astuple(self)


def connection_kwargs(kafka: KafkaConfig) -> dict[str, Any]:
    """kafka-python keyword arguments for bootstrap, client id and security."""
    kw: dict[str, Any] = {
        "bootstrap_servers": [s.strip() for s in kafka.bootstrap_servers.split(",") if s.strip()],
        "client_id": kafka.client_id,
        "security_protocol": kafka.security_protocol,
    }
    if kafka.sasl_mechanism:
        kw["sasl_mechanism"] = kafka.sasl_mechanism
        kw["sasl_plain_username"] = kafka.sasl_username
        kw["sasl_plain_password"] = kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        value = getattr(kafka, name)
        if value is not None:
            kw[name] = str(value)
    return kw


FETCH_BYTES = 16 << 20  # a fetch response's usual bound: many records of every assigned partition
FRAME_HEADROOM = 1 << 20  # a response's headers around its records


def fetch_sizes(max_message_bytes: int) -> dict[str, int]:
    """kafka-python consumer settings that take the broker's largest message (`kafka.max_message_bytes`).

    kafka-python's own cannot: a network frame may hold 1,000,000 bytes (`receive_message_max_bytes`)
    while a fetch response may be 50 MiB (`fetch_max_bytes`), so a response carrying a 1 MB record
    fails with InvalidReceiveError, drops the connection and is fetched again. Here a partition fetch
    takes at least the largest message, a fetch at least two of them (else 16 MiB), and a frame a
    whole fetch response.
    """
    partition = max(max_message_bytes, 1 << 20)
    fetch = max(FETCH_BYTES, 2 * partition)
    return {
        "max_partition_fetch_bytes": partition,
        "fetch_max_bytes": fetch,
        "receive_message_max_bytes": fetch + FRAME_HEADROOM,
    }


def consumer_kwargs(kafka: KafkaConfig) -> dict[str, Any]:
    """kafka-python consumer keyword arguments: the connection's and the fetch sizes (`fetch_sizes`)."""
    return connection_kwargs(kafka) | fetch_sizes(kafka.max_message_bytes)


def unreachable(kafka: KafkaConfig, error: Exception) -> DynrubricError:
    why = type(error).__name__ + (f": {error}" if str(error) not in ("", type(error).__name__) else "")
    return DynrubricError(
        f"no Kafka broker answers at {kafka.bootstrap_servers} ({why})",
        "start the embedded one with `dynrubric broker start`, or set kafka.bootstrap_servers "
        "(env DYNRUBRIC_KAFKA__BOOTSTRAP_SERVERS)",
    )


def ensure_topics(kafka: KafkaConfig, names: tuple[str, ...] | list[str] | None = None) -> None:
    """Create the topics (default: the three of `Topics.of(kafka)`) that do not exist yet; existing ones stay."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import NoBrokersAvailable, TopicAlreadyExistsError

    try:
        admin = KafkaAdminClient(**connection_kwargs(kafka))
    except NoBrokersAvailable as e:
        raise unreachable(kafka, e) from None
    names = Topics.of(kafka).all() if names is None else names
    try:
        # create and tolerate "already exists" (a racing creator too); list_topics is avoided because
        # kafka-python 2.3 cannot parse the authorized-operations bits Tansu returns with it
        for name in names:
            topic = NewTopic(
                name,
                kafka.topic_partitions,
                kafka.topic_replication_factor,
                topic_configs={"retention.ms": str(kafka.topic_retention_ms)},
            )
            try:
                admin.create_topics([topic])
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()

"""The Kafka consumer ingest reads with, behind one small interface: kafka-python or confluent-kafka.

`ingest.client` picks the library. kafka-python (pure Python, the default: the project's card depends on
it) decodes every record in Python, which caps one process at a few thousand events per second;
confluent-kafka wraps librdkafka, which fetches and decodes in C threads. Both are used the same way:
one consumer in the group `ingest.group_id`, no auto-commit, offsets committed synchronously by the
caller, rebalance callbacks run inside `poll` on the caller's thread (so a revocation can finish and
commit what was read before the partitions move).

A partition is `(topic, partition)`; a poll returns each partition's records as columns (`Fetched`), in
offset order, so that the caller builds its own records without one more object per message.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynrubric.config import IngestConfig, KafkaConfig
from dynrubric.errors import DynrubricError
from streaming.kafka import connection_kwargs, consumer_kwargs

log = logging.getLogger(__name__)
Partition = tuple[str, int]
OnPartitions = Callable[[list[Partition]], None]


@dataclass
class Fetched:
    """One partition's records of a poll, in offset order."""

    topic: str
    partition: int
    offsets: list[int] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)


class Consumer(abc.ABC):
    """What ingest needs from a group consumer."""

    @abc.abstractmethod
    def subscribe(self, topics: Sequence[str], on_assigned: OnPartitions, on_revoked: OnPartitions) -> None:
        """Join the group for `topics`; the callbacks run inside `poll`."""

    @abc.abstractmethod
    def poll(self, timeout_s: float, max_records: int) -> list[Fetched]:
        """Up to `max_records` records, waiting at most `timeout_s` for the first."""

    @abc.abstractmethod
    def assignment(self) -> list[Partition]: ...

    @abc.abstractmethod
    def commit(self, offsets: dict[Partition, int]) -> None:
        """Commit the next offsets to consume, synchronously; raises when the broker refused them."""

    @abc.abstractmethod
    def committed(self, partition: Partition) -> int | None:
        """The group's committed offset of `partition` (None: none yet)."""

    @abc.abstractmethod
    def highwater(self, partition: Partition) -> int | None:
        """The partition's end offset as the last fetch response reported it (None: not fetched yet)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the group without committing."""


# ---------------------------------------------------------------- kafka-python
class KafkaPythonConsumer(Consumer):
    def __init__(self, kafka: KafkaConfig, cfg: IngestConfig):
        from kafka import KafkaConsumer

        self._consumer = KafkaConsumer(
            **consumer_kwargs(kafka),  # the connection's settings and fetch sizes that take the largest message
            group_id=cfg.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=heartbeat_ms(cfg),
            max_poll_records=cfg.batch_max_records,
        )

    def subscribe(self, topics: Sequence[str], on_assigned: OnPartitions, on_revoked: OnPartitions) -> None:
        from kafka import ConsumerRebalanceListener

        class Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked) -> None:
                on_revoked([(tp.topic, tp.partition) for tp in revoked])

            def on_partitions_assigned(self, assigned) -> None:
                on_assigned([(tp.topic, tp.partition) for tp in assigned])

        self._consumer.subscribe(list(topics), listener=Listener())

    def poll(self, timeout_s: float, max_records: int) -> list[Fetched]:
        polled = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        return [
            Fetched(
                tp.topic,
                tp.partition,
                [r.offset for r in records],
                [r.key for r in records],
                [r.value for r in records],
            )
            for tp, records in polled.items()
        ]

    def assignment(self) -> list[Partition]:
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    def commit(self, offsets: dict[Partition, int]) -> None:
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        self._consumer.commit({TopicPartition(t, p): OffsetAndMetadata(off, "", -1) for (t, p), off in offsets.items()})

    def committed(self, partition: Partition) -> int | None:
        from kafka import TopicPartition

        return self._consumer.committed(TopicPartition(*partition))

    def highwater(self, partition: Partition) -> int | None:
        from kafka import TopicPartition

        return self._consumer.highwater(TopicPartition(*partition))  # Tansu's end_offsets under-reports

    def close(self) -> None:
        self._consumer.close(autocommit=False)


# ---------------------------------------------------------------- confluent-kafka (librdkafka)
def confluent_settings(kafka: KafkaConfig) -> dict[str, Any]:
    """librdkafka's names for `connection_kwargs`' connection settings."""
    kw = connection_kwargs(kafka)
    conf: dict[str, Any] = {
        "bootstrap.servers": ",".join(kw["bootstrap_servers"]),
        "client.id": kw["client_id"],
        "security.protocol": kw["security_protocol"],
    }
    names = {
        "sasl_mechanism": "sasl.mechanisms",
        "sasl_plain_username": "sasl.username",
        "sasl_plain_password": "sasl.password",
        "ssl_cafile": "ssl.ca.location",
        "ssl_certfile": "ssl.certificate.location",
        "ssl_keyfile": "ssl.key.location",
    }
    conf.update({names[k]: v for k, v in kw.items() if k in names and v is not None})
    return conf


class ConfluentConsumer(Consumer):
    def __init__(self, kafka: KafkaConfig, cfg: IngestConfig):
        from dynrubric.extras import require

        confluent = require("confluent_kafka", "confluent", "ingest.client: confluent")
        self._tp = confluent.TopicPartition
        self._errors = confluent.KafkaError
        self._consumer = confluent.Consumer(
            {
                **confluent_settings(kafka),
                "group.id": cfg.group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "session.timeout.ms": cfg.session_timeout_ms,
                "heartbeat.interval.ms": heartbeat_ms(cfg),
                "enable.partition.eof": False,
                "logger": log,
            }
        )

    def subscribe(self, topics: Sequence[str], on_assigned: OnPartitions, on_revoked: OnPartitions) -> None:
        def parts(tps) -> list[Partition]:
            return [(tp.topic, tp.partition) for tp in tps]

        # eager rebalancing: librdkafka assigns the partitions itself once on_assign returns
        self._consumer.subscribe(
            list(topics),
            on_assign=lambda _, tps: on_assigned(parts(tps)),
            on_revoke=lambda _, tps: on_revoked(parts(tps)),
        )

    def poll(self, timeout_s: float, max_records: int) -> list[Fetched]:
        by_partition: dict[Partition, Fetched] = {}
        for msg in self._consumer.consume(num_messages=max_records, timeout=timeout_s):
            error = msg.error()
            if error is not None:
                if error.fatal():
                    raise DynrubricError(
                        f"the Kafka consumer failed: {error.str()}",
                        "check the broker and the kafka.* connection settings",
                    )
                log.warning("Kafka consumer error (retried by librdkafka): %s", error.str())
                continue
            key = (msg.topic(), msg.partition())
            fetched = by_partition.get(key)
            if fetched is None:
                fetched = by_partition[key] = Fetched(*key)
            fetched.offsets.append(msg.offset())
            fetched.keys.append(msg.key())
            fetched.values.append(msg.value())
        return list(by_partition.values())

    def assignment(self) -> list[Partition]:
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    def commit(self, offsets: dict[Partition, int]) -> None:
        self._consumer.commit(offsets=[self._tp(t, p, off) for (t, p), off in offsets.items()], asynchronous=False)

    def committed(self, partition: Partition) -> int | None:
        [tp] = self._consumer.committed([self._tp(*partition)], timeout=30)
        return tp.offset if tp.offset >= 0 else None  # OFFSET_INVALID: nothing committed yet

    def highwater(self, partition: Partition) -> int | None:
        _, high = self._consumer.get_watermark_offsets(self._tp(*partition), cached=True)
        return high if high >= 0 else None

    def close(self) -> None:
        self._consumer.close()


def heartbeat_ms(cfg: IngestConfig) -> int:
    return max(100, min(3000, cfg.session_timeout_ms // 3))


def make_consumer(kafka: KafkaConfig, cfg: IngestConfig) -> Consumer:
    """The consumer `ingest.client` names."""
    return ConfluentConsumer(kafka, cfg) if cfg.client == "confluent" else KafkaPythonConsumer(kafka, cfg)

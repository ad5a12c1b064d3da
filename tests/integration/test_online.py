"""Online metrics: attribution by experiment and assigned arm, bounded state, restart from committed offsets."""

from __future__ import annotations

import json
import uuid

import pytest

from serving.online import OnlineMetrics

Q, F = "q", "f"


def request(
    rid: str,
    user: str,
    arm: str,
    *,
    experiment: str = "ro-1",
    served: str | None = None,
    ts: float = 100.0,
    latency_ms: float = 400.0,
    **extra,
) -> bytes:
    return json.dumps(
        {
            "request_id": rid,
            "user_key": user,
            "experiment_id": experiment,
            "assigned_variant": arm,
            "variant": served or arm,
            "ts": ts,
            "latency_ms": latency_ms,
            "messages": [{"role": "user", "content": f"prompt of {rid}"}],
            "response": f"answer {rid}",
        }
        | extra
    ).encode()


def feedback(rid: str, kind: str) -> bytes:
    return json.dumps({"request_id": rid, "kind": kind}).encode()


def metrics(**kw) -> OnlineMetrics:
    m = OnlineMetrics("unused:9092", Q, F, **kw)
    m.track("ro-1", 0, 0.0)
    return m


def test_rates_are_per_user_and_attributed_by_experiment_and_assigned_arm():
    m = metrics()
    for i in range(9):  # a heavy user: 9 requests, all thumbs up
        m.apply(Q, request(f"h{i}", "heavy", "canary"))
        m.apply(F, feedback(f"h{i}", "thumbs_up"))
    m.apply(F, feedback("l0", "thumbs_down"))  # feedback read before its request waits for it
    m.apply(Q, request("l0", "light", "canary"))
    m.apply(Q, request("x0", "other", "canary", experiment="ro-0"))  # another rollout's traffic
    m.apply(Q, request("f0", "light", "canary", served="stable", latency_ms=9000.0))  # canary failed, stable answered
    m.apply(F, feedback("f0", "regenerate"))
    m.apply(Q, request("s0", "s-user", "stable"))
    m.apply(F, feedback("s0", "thumbs_up"))
    m.apply(F, feedback("s0", "thumbs_down"))  # a changed mind: the last verdict counts
    canary, stable = m.arm_stats("canary", errors=1, routed=12, settled=12), m.arm_stats("stable")
    assert canary.users == 2 and canary.rated == 10 and canary.requests == 12
    assert canary.positive.rate == pytest.approx((1.0 + 0.0) / 2)  # per user, not 9/10 per request
    assert canary.regenerated.rate == pytest.approx((0.0 + 0.5) / 2)
    assert canary.errors.rate == pytest.approx(1 / 12)
    # 10 of the 12 still in flight: the rate is over the 2 whose outcome is known, not diluted by the 10
    assert m.arm_stats("canary", errors=1, routed=12, settled=2).errors.rate == pytest.approx(1 / 2)
    assert canary.latency.n == 10  # the stable-answered request's latency is not the canary's
    assert stable.users == 1 and stable.positive.rate == 0.0 and stable.rated == 1
    assert m.skipped == 1


def test_steps_count_users_seen_since_the_step_began():
    m = metrics()
    m.apply(Q, request("a", "u1", "stable", ts=10.0))
    m.track("ro-1", 1, 50.0)
    m.apply(Q, request("b", "u1", "stable", ts=60.0))
    m.apply(Q, request("c", "u1", "stable", ts=61.0))
    m.apply(Q, request("d", "u2", "canary", ts=62.0))
    assert (m.arm_stats("stable").step_users, m.arm_stats("stable").step_requests) == (1, 2)
    assert m.arm_stats("canary").step_users == 1
    m.track("ro-2", 0, 0.0)  # a new rollout starts from nothing
    assert m.arm_stats("stable").users == 0


def test_shadow_pairs_are_paired_and_kept_out_of_user_metrics():
    m = metrics()
    m.apply(Q, request("p1:shadow", "u", "canary", pair_id="p1", shadow=True))  # the shadow may be read first
    m.apply(Q, request("p1", "u", "stable", pair_id="p1"))
    (pair,) = m.take_pairs(5)
    assert (pair.prompt, pair.stable, pair.canary) == ("prompt of p1", "answer p1", "answer p1:shadow")
    assert m.arm_stats("canary").users == 0 and m.arm_stats("stable").requests == 1
    m.add_judged([0.0, 0.5])
    assert m.judge.pairs == 2 and m.judge.win_rate == 0.25


def test_feedback_window_and_waiting_queues_are_bounded():
    m = metrics(feedback_window_s=10.0, max_waiting=100)
    for i in range(1000):
        m.apply(Q, request(f"r{i}", f"u{i % 7}", "stable", ts=float(i)))
        m.apply(F, feedback(f"never-{i}", "thumbs_up"))
    assert len(m.window) <= 12 and len(m.early_feedback) == 100
    m.apply(F, feedback("r995", "thumbs_up"))
    m.apply(F, feedback("r3", "thumbs_up"))  # its request left the window: not attributed
    assert m.arm_stats("stable").rated == 1


def test_restart_resumes_from_committed_offsets(kafka_broker, tmp_path):
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    q, f, group = (f"t-{uuid.uuid4().hex[:8]}-{n}" for n in ("q", "f", "g"))
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.create_topics([NewTopic(q, 2, 1), NewTopic(f, 1, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=kafka_broker)

    def send(start: int, stop: int) -> None:
        for i in range(start, stop):
            producer.send(q, key=f"r{i}".encode(), value=request(f"r{i}", f"u{i % 13}", ("stable", "canary")[i % 2]))
            producer.send(f, key=f"r{i}".encode(), value=feedback(f"r{i}", ("thumbs_up", "thumbs_down")[i % 3 == 0]))
        producer.flush()

    def drained(m: OnlineMetrics, expected: int) -> None:
        for _ in range(30):
            m.poll(budget_s=1.0)
            if sum(m.arm_stats(a).requests for a in ("stable", "canary")) == expected:
                return
        raise AssertionError("not all events were read")

    state = tmp_path / "online.json"
    send(0, 200)
    first = OnlineMetrics(kafka_broker, q, f, group_id=group, state_path=state)
    first.track("ro-1", 0, 0.0)
    drained(first, 200)
    first.checkpoint()
    committed = first.committed()
    first.close()  # the controller dies here
    assert sum(v for k, v in committed.items() if k.startswith(q)) == 200
    assert committed == json.loads(state.read_text())["offsets"]

    send(200, 300)
    second = OnlineMetrics(kafka_broker, q, f, group_id=group, state_path=state)
    second.track("ro-1", 0, 0.0)
    assert second.committed() == committed  # the group's offsets, where the new instance starts
    drained(second, 300)
    fresh = OnlineMetrics(kafka_broker, q, f, group_id=f"{group}-fresh")  # read everything once, no restart
    fresh.track("ro-1", 0, 0.0)
    drained(fresh, 300)
    for arm in ("stable", "canary"):
        a, b = second.arm_stats(arm).positive, fresh.arm_stats(arm).positive
        assert (a.n, a.s, a.ss) == (b.n, pytest.approx(b.s), pytest.approx(b.ss))
        assert second.arm_stats(arm).rated == fresh.arm_stats(arm).rated == 150  # each request counted once
    for m in (second, fresh):
        m.close()
    producer.close()


def test_a_one_megabyte_event_is_read_without_a_dropped_connection(kafka_broker, caplog):
    """A response as large as the broker takes (`kafka.max_message_bytes`) among small ones: every event is read,
    and kafka-python never drops the connection with InvalidReceiveError (its own frame limit, 1,000,000
    bytes, is below a fetch response that carries such an event: `streaming.kafka.fetch_sizes`)."""
    from kafka import KafkaProducer
    from kafka.admin import KafkaAdminClient, NewTopic

    q, f = (f"t-{uuid.uuid4().hex[:8]}-{n}" for n in ("q", "f"))
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    admin.create_topics([NewTopic(q, 1, 1), NewTopic(f, 1, 1)])
    admin.close()
    producer = KafkaProducer(bootstrap_servers=kafka_broker, max_request_size=2_000_000)
    for i in range(6):
        big = {"response": "x" * 1_000_000} if i in (1, 2) else {}
        producer.send(q, value=request(f"r{i}", f"u{i}", ("stable", "canary")[i % 2], **big))
    producer.flush()
    producer.close()
    m = OnlineMetrics(kafka_broker, q, f, group_id=f"{q}-g")
    m.track("ro-1", 0, 0.0)
    try:
        for _ in range(20):
            m.poll(budget_s=1.0)
            if sum(m.arm_stats(a).requests for a in ("stable", "canary")) == 6:
                break
        assert sum(m.arm_stats(a).requests for a in ("stable", "canary")) == 6
    finally:
        m.close()
    dropped = [r.getMessage() for r in caplog.records if "InvalidReceiveError" in r.getMessage()]
    assert not dropped, dropped

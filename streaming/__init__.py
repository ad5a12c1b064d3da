"""Kafka side of dynrubric: event schemas, producer, ingest, dead letters, dedupe, replay store, embedded broker."""

"""Joining the Ray cluster of the `ray` config section, and the cores a worker in it computes on (the
round's Ray executor, bulk scoring)."""

from __future__ import annotations

from dynrubric.config import Settings


def connect(settings: Settings) -> None:
    """Join `ray.address`, or start a local Ray when it is unset (`ray.num_cpus`, no dashboard); once
    per process, and not at all when the caller already started or joined one."""
    import ray

    if ray.is_initialized():
        return
    cfg = settings.ray
    if cfg.address is None:
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=cfg.address, log_to_driver=False, configure_logging=False)


def use_cores(threads: int, sharers: int = 1) -> int:
    """Set this actor's torch threads: `engine.threads` when set, else the CPUs Ray reserved for the actor
    (`ray.actor_cpus` >= 1), else its share of its node's cores among `sharers` actors that work at once
    (1: every core, as the in-process round uses them; its stages run one after another). Returns the
    number set."""
    import os

    import ray
    import torch

    reserved = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    # Ray sets OMP_NUM_THREADS=1 in an actor that reserves under one CPU: torch would then use one core of
    # a node whose other cores sit idle while the round waits on this actor
    n = threads or (int(reserved) if reserved >= 1 else max(1, len(os.sched_getaffinity(0)) // sharers))
    torch.set_num_threads(n)
    return n

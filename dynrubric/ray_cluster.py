"""Joining the Ray cluster of the `ray` config section (the round's Ray executor, bulk scoring)."""

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

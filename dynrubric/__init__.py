"""dynrubric: continuous post-training from production traffic with co-evolving set-conditioned rubrics."""

__version__ = "0.1.0"

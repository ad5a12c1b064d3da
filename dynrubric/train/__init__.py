"""Policy updates: the embedded GRPO trainer, resumable rounds, evaluator co-evolution, guards, OpenRLHF."""

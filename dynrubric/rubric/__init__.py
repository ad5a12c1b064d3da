"""The DynamicRubric evaluator: set-conditioned rubric generation, P(yes) verdicts, scores, score gaps."""

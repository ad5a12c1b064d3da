"""The application: the CLI, the closed loop that wires the tiers (`dynrubric up`), supervision, reports and
the doctor. It imports the core (`dynrubric/{engines,rubric,train}`) and the tiers (`streaming/`, `serving/`);
nothing below imports it."""

"""The one error type the CLI turns into a single line: what was wrong, and what to do about it."""


class DynrubricError(Exception):
    """An error a user can act on. `problem` names the thing that was wrong, `fix` what to do."""

    exit_code = 2

    def __init__(self, problem: str, fix: str = ""):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}" + (f" -> {fix}" if fix else ""))

"""The one error type for everything a user caused, and the list of them that ``check`` gathers.

A ``UserError`` says what is wrong (naming the key and its value) and the fix. The CLI prints it
as one line, exits 2 and launches nothing; bugs in zerorun stay ordinary exceptions (tracebacks).
"""
from __future__ import annotations

from typing import Any, Iterable, List, Union


class UserError(ValueError):
    """A problem the user can fix: ``what`` (with the key and value), then ``Fix: fix``."""

    def __init__(self, what: str, fix: str = "", *, key: str = "", value: Any = None):
        self.what, self.fix, self.key, self.value = what, fix, key, value
        super().__init__(f"{what} Fix: {fix}" if fix else what)

    @property
    def message(self) -> str:
        return str(self)


class ConfigError(UserError):
    """Every problem found in a config at once (torchtune's "found the following errors")."""

    def __init__(self, problems: Iterable[Union[UserError, str]]):
        self.problems: List[UserError] = [p if isinstance(p, UserError) else UserError(str(p)) for p in problems]
        super().__init__("config is not valid:\n" + "\n".join(f"  - {p}" for p in self.problems))


class DataError(UserError):
    """Bad input data: the message names the file and line."""


class ModelLoadError(UserError):
    """Pretrained weights could not be loaded; the message says how to fix it offline."""

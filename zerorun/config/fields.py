"""Constraints declared beside each schema field, and the one checker that derives every refusal from them.

A schema field states what it accepts where it is declared (pydantic's ``Field(gt=0)``, as dataclass field
metadata): ``lr: float = num(3e-4, gt=0)``, ``path: str = path_field(PathKind.file)``. ``field_problems``
walks a RunConfig and turns each declaration into a refusal that names the key, its value and a valid one;
``tests/unit/test_fields.py`` fails for a numeric or string field declared without one. Cross-field rules
(node_rank < nnodes, ZeRO-3 for parameter offload) stay in rules.py and checks.py.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Tuple

from .errors import UserError

INT_MAX = 2**63 - 1
MISSING_VALUE = "???"  # omegaconf.MISSING  # what torch, numpy and DeepSpeed's JSON take as an integer


@dataclass(frozen=True)
class Bound:
    """A finite number (each element of a list) in a range: ``ge``/``gt`` below, ``le``/``lt`` above."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    length: Optional[int] = None
    """Lists: exactly this many elements."""

    def describe(self) -> str:
        n = _number
        lo = f"[{n(self.ge)}" if self.ge is not None else f"({n(self.gt)}" if self.gt is not None else None
        hi = f"{n(self.le)}]" if self.le is not None else f"{n(self.lt)})" if self.lt is not None else None
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f"at least {n(self.ge)}" if self.ge is not None else f"greater than {n(self.gt)}"
        if hi:
            return f"at most {n(self.le)}" if self.le is not None else f"less than {n(self.lt)}"
        return "a finite number"

    def problem(self, value: Any) -> Optional[str]:
        """None when ``value`` satisfies the bound, else what is wrong with it."""
        if isinstance(value, (list, tuple)):
            if self.length is not None and len(value) != self.length:
                return f"must hold {self.length} numbers"
            return next((f"element {v!r} {p}" for v in value for p in [self.problem(v)] if p), None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number ({type(value).__name__} given)"
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be finite, {self.describe()}"
        if isinstance(value, int) and abs(value) > INT_MAX:
            return f"is too large (more than 2**63 - 1), must be {self.describe()}"
        ok = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
              and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        return None if ok else f"must be {self.describe()}"


class PathKind(str, enum.Enum):
    file = "file"              # an existing, readable file
    dir = "dir"                # an existing, readable directory
    out_dir = "out_dir"        # a directory zerorun writes into: exists or can be made, writable
    source = "source"          # a local directory, or a hub name / pkg:// reference (checked where it is read)
    resume = "resume"          # a run dir or checkpoint dir holding a complete checkpoint


@dataclass(frozen=True)
class Text:
    """A free-form string; ``nonempty`` where an empty one means nothing."""

    nonempty: bool = False


def num(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None, length=None,
        factory=None) -> Any:
    """A numeric field (or a list of numbers) with its valid range declared."""
    meta = {"bound": Bound(ge, gt, le, lt, length)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def path_field(kind: PathKind, default: str = "") -> Any:
    """A path (empty: zerorun's default place); what must be there is checked before launch (config/paths.py)."""
    return field(default=default, metadata={"path": kind})


def text(default: Any = dataclasses.MISSING, *, nonempty: bool = False) -> Any:
    return field(default=default, metadata={"text": Text(nonempty)})


def declared(f: dataclasses.Field) -> Optional[Any]:
    """The constraint a field declares (Bound, PathKind or Text), or None."""
    return next((f.metadata[k] for k in ("bound", "path", "text") if k in f.metadata), None)


def leaves(obj: Any, prefix: str = "") -> Iterator[Tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) for every leaf of a schema object, depth first."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


def field_problems(cfg: Any) -> List[UserError]:
    """Every field whose value breaks its declared bound or text rule, each naming key, value and a valid one."""
    out = []
    for key, f, value in leaves(cfg):
        rule = declared(f)
        if value is None or rule is None:
            continue  # Optional fields: None means "zerorun decides"
        if isinstance(rule, Bound):
            why = rule.problem(value)
        elif isinstance(rule, Text):
            why = "must not be empty" if rule.nonempty and not str(value).strip() else None
        else:
            why = None  # paths: config/paths.py looks at the filesystem
        if why:
            out.append(UserError(f"{key}={_show(value)}: {why}.", _fix(key, f), key=key, value=value))
    return out


def with_defaults_for(cfg: Any, problems: List[UserError]) -> Optional[Any]:
    """``cfg`` with each field named in ``problems`` set back to its declared default, so the cross-field
    rules can still run (and report their own problems) without meeting out-of-range values; None when a
    field has no default to fall back on (a model's architecture: MISSING until a model file sets it)."""
    bad = {p.key for p in problems}
    if any(f.default == MISSING_VALUE for key, f, _ in leaves(cfg) if key in bad):
        return None

    def fix(obj: Any, prefix: str) -> Any:
        changes = {}
        for f in dataclasses.fields(obj):
            value, key = getattr(obj, f.name), f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                changes[f.name] = fix(value, f"{key}.")
            elif key in bad:
                changes[f.name] = _default(f)
        return dataclasses.replace(obj, **changes)

    return fix(cfg, "")


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None if f.default is dataclasses.MISSING else f.default


def _fix(key: str, f: dataclasses.Field) -> str:
    default = _default(f)
    if default is None or default == "":
        return "leave it unset, or give a valid value (zerorun --help lists each key's range)."
    return f"{key}={_show(default)} (the default)."


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return repr(value) if isinstance(value, str) and not value.strip() else str(value)

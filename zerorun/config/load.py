"""From overrides to a typed RunConfig: the key-typo check and composition, for every entry point.

One walker (``schema_problem``) looks a dotted key up in the schema. It checks the command line before
Hydra composes (Hydra's own answer to a typo suggests ``+key=``, which would add the typo silently)
and the composed tree afterwards (keys added with ``+`` and keys from group files).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from .errors import ConfigError, UserError
from .schema import Family, RunConfig, register_schemas

if TYPE_CHECKING:  # OmegaConf is imported where a tree is composed: a cached estimate never needs it
    from omegaconf import DictConfig


def _field_type(f: dataclasses.Field) -> Any:
    """The nested schema of a field (a dataclass), or None for a leaf or a free-form dict."""
    factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
    return factory if factory is not None and dataclasses.is_dataclass(factory) else None


@functools.lru_cache(maxsize=1)
def schema_keys() -> Tuple[str, ...]:
    """Every dotted key of the schema, leaves and groups."""
    def walk(node, prefix):
        for f in dataclasses.fields(node):
            yield prefix + f.name
            sub = _field_type(f)
            if sub is not None:
                yield from walk(sub, f"{prefix}{f.name}.")
    return tuple(walk(RunConfig, ""))


def schema_problem(key: str) -> Optional[str]:
    """None when the dotted ``key`` is in the schema (or below a free-form dict such as deepspeed.*),
    else why not, with the closest spelling."""
    node: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if node is dict:
            return None  # below a free-form dict (deepspeed.*, model.hf_config.*): DeepSpeed/transformers check it
        if node is None:
            return f"{'.'.join(parts[:i])} is a single value, not a group of keys"
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            close = difflib.get_close_matches(part, fields, n=1)
            where = ".".join(parts[:i]) or "the config"
            respelled = ".".join(parts[:i] + close[:1] + parts[i + 1:])
            if close and schema_problem(respelled) is None:  # run.dir is not dry_run.dir: a bool has no keys
                return f"did you mean {respelled}?"
            # the right name in another group (optimizer.lr is trainer.lr)
            elsewhere = [k for k in schema_keys() if k.rsplit(".", 1)[-1] == parts[-1]] if i == len(parts) - 1 else []
            return f"did you mean {elsewhere[0]}?" if len(elsewhere) == 1 else f"{where} has: {', '.join(fields)}"
        node = _field_type(fields[part]) or (dict if fields[part].default_factory is dict else None)
    return None


def unknown_override_keys(overrides: Sequence[str]) -> List[UserError]:
    """Command-line overrides whose key is not in the schema (typos), before Hydra composes."""
    problems = []
    for ov in overrides:
        if "=" not in ov or ov[0] in "+~" or ov.startswith(("hydra.", "hydra/", "-")):
            continue
        key = ov.split("=", 1)[0]
        if "." not in key:
            continue  # a group choice (zero=stage2) or a top-level value: Hydra checks those
        hint = schema_problem(key)
        if hint:
            problems.append(UserError(f"unknown key {key} ({hint}).", "correct the spelling.", key=key))
    return problems


def group_options() -> dict:
    """Each config group of the packaged conf/ and its options (the YAML files in it)."""
    import importlib.resources

    root = importlib.resources.files("zerorun.conf")
    return {d.name: sorted(f.name[:-5] for f in d.iterdir() if f.name.endswith(".yaml"))
            for d in root.iterdir() if d.is_dir() and not d.name.startswith("_")}


def unknown_group_choices(overrides: Sequence[str]) -> List[UserError]:
    """``group=option`` overrides (sweep lists ``a,b`` too) naming an option conf/ does not have, before Hydra
    composes: its own answer is a multi-line block and exit 1."""
    groups, problems = group_options(), []
    for ov in overrides:
        if "=" not in ov or ov.startswith(("hydra", "-", "~")):
            continue
        key, value = ov.split("=", 1)
        group = key.lstrip("+")
        if group not in groups or any(c in value for c in "()[]{}$*?"):
            continue  # not a group, or a sweep expression Hydra expands itself
        for option in value.split(","):
            if option and option != "null" and option not in groups[group]:
                close = difflib.get_close_matches(option, groups[group], n=1)
                problems.append(UserError(
                    f"{key}={option}: Could not find '{group}/{option}'; {group} has: {', '.join(groups[group])}.",
                    f"{key}={close[0]}?" if close else f"one of {', '.join(groups[group])}.", key=group, value=option))
    return problems


def unknown_keys(node: Any, prefix: str = "") -> List[str]:
    """Dotted keys of a composed tree that the schema does not have, each with its hint."""
    found = []
    for key in node.keys() if hasattr(node, "keys") else []:
        path = f"{prefix}{key}"
        hint = schema_problem(path)
        if hint:
            found.append(f"{path}" + (f" ({hint})" if hint.startswith("did you mean") else ""))
        elif hasattr(node[key], "keys") and _is_schema_node(path):
            found += unknown_keys(node[key], f"{path}.")
    return found


def _is_schema_node(path: str) -> bool:
    node: Any = RunConfig
    for part in path.split("."):
        node = _field_type({f.name: f for f in dataclasses.fields(node)}[part])
        if node is None:
            return False
    return True


def to_run_config(cfg: DictConfig | RunConfig, files_read: Optional[List[Optional[str]]] = None) -> RunConfig:
    """A plain, fully resolved RunConfig object (enums as enums) from a composed config; the checkpoint
    config.json it reads, if any, is appended to ``files_read`` (None where it came from the hub)."""
    from omegaconf import OmegaConf

    if isinstance(cfg, RunConfig):
        return cfg
    extra = unknown_keys(cfg)
    if extra:
        raise ConfigError([UserError(f"unknown key {k}.", "check the spelling (zerorun --cfg job lists every key).",
                                     key=k.split(" ")[0]) for k in extra])
    try:
        merged = OmegaConf.merge(_schema(), cfg)
        OmegaConf.resolve(merged)
        out = OmegaConf.to_object(merged)
    except Exception as e:  # a wrong type or an invalid enum value
        raise typing_error(e) from None
    from .paths import expanded

    return with_architecture_of_checkpoint(expanded(out), files_read)


def with_architecture_of_checkpoint(cfg: RunConfig, files_read: Optional[List[Optional[str]]] = None) -> RunConfig:
    """``model.from_config_json=true`` (the ``hf`` model file): the architecture fields read from the checkpoint's
    config.json (a local directory or file; on the hub, when it can be reached), then the flag cleared, so the run
    dir's config.yaml holds the numbers and the ranks never read it again."""
    m = cfg.model
    from ..arch import ArchitectureError, model_fields_from_config_json, traits

    if not m.from_config_json and traits(m).traced:  # a traced model file: its summary fields follow its hf_config
        from ..arch.config_json import traced_fields

        try:
            fields = traced_fields(m.model_type, {"model_type": m.model_type, **m.hf_config}, f"model {m.name}")
        except ArchitectureError as e:
            raise UserError(str(e), key="model.hf_config", value=m.model_type) from None
        fields["family"] = Family(fields["family"])
        return dataclasses.replace(cfg, model=dataclasses.replace(m, **fields))
    if not m.from_config_json:
        return cfg

    source = m.name_or_path
    if source.startswith("pkg://"):
        from ..models import resolve_pkg_path

        source = resolve_pkg_path(source)
    read = source if os.path.exists(source) else None
    if read is None:
        source = _hub_config_json(source)
    if files_read is not None:
        files_read.append(os.path.join(read, "config.json") if read and os.path.isdir(read) else read)
    try:
        fields = model_fields_from_config_json(source)
    except ArchitectureError as e:
        raise UserError(str(e), key="model.name_or_path", value=m.name_or_path) from None
    fields["family"] = Family(fields["family"])
    model = dataclasses.replace(m, **fields, from_config_json=False)
    return dataclasses.replace(cfg, model=model)


def _hub_config_json(name: str) -> str:
    """A hub repository's config.json, downloaded (or read from the local hub cache) when the hub can be reached."""
    from ..models import hub_reachable

    fix = ("a local checkpoint directory (model.name_or_path=/path/to/it, with its config.json), or a shipped model "
           "file (+model=llama-3.2-1b, qwen2.5-0.5b, mistral-7b, ...)")
    if not hub_reachable():
        raise UserError(f"model.name_or_path={name}: no such local path, and the hub cannot be reached to read its "
                        "config.json.", fix, key="model.name_or_path", value=name)
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(name, "config.json")
    except Exception as e:  # not found, gated, no network after all
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"model.name_or_path={name}: could not read its config.json from the hub ({first}).", fix,
                        key="model.name_or_path", value=name) from None


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The typed schema, built once (12 ms): OmegaConf.merge copies it, never changes it."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(RunConfig)


def typing_error(e: Exception) -> UserError:
    """OmegaConf's refusal of a value (wrong type, unknown enum, bad interpolation) as one line naming the key
    (its full_key), whatever the message's first line says."""
    from omegaconf import OmegaConf

    key = str(getattr(e, "full_key", "") or "")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    try:
        default = OmegaConf.select(_schema(), key) if key else None
    except Exception:  # noqa: BLE001 (a key the schema cannot select: no default to show)
        default = None
    shown = str(default).lower() if isinstance(default, bool) else getattr(default, "name", default)  # enum: name
    fix = f"{key}={shown} (the default) or another value of its type." if default not in (None, "") and \
        not hasattr(default, "keys") else "check the key's type (zerorun --cfg job shows every key with its value)."
    what = f"{key}: {first}" if key and key not in first else first
    return UserError(what if what.endswith((".", "?")) else f"{what}.", fix, key=key)


def compose(overrides: Sequence[str], cached: bool = False) -> RunConfig:
    """The RunConfig ``zerorun <overrides>`` would run, composed in-process (zerorun-estimate, tests):
    the same typo check, Hydra composition and typing as the zerorun command. ``cached``: kept on disk and
    reused while nothing it was composed from changes (compose_cache.py)."""
    if cached:
        from . import compose_cache

        return compose_cache.cached(overrides, _compose)
    return _compose(overrides, [])


def _compose(overrides: Sequence[str], files_read: List[Optional[str]]) -> RunConfig:
    from hydra import compose as hydra_compose, initialize_config_module

    typos = unknown_override_keys(overrides) + unknown_group_choices(overrides)
    if typos:
        raise ConfigError(typos)
    register_schemas()
    try:
        with initialize_config_module("zerorun.conf", version_base=None):
            raw = hydra_compose("config", overrides=list(overrides))
    except Exception as e:  # an unknown group option or a malformed override: Hydra's first line says which
        if type(e.__cause__).__module__.startswith("omegaconf"):  # a value of the wrong type: the key says which
            raise typing_error(e.__cause__) from None
        raise UserError(str(e).strip().splitlines()[0]) from None
    return to_run_config(raw, files_read)


def hydra_words_problem(args: List[str]) -> None:
    """What Hydra itself would fail on after its banner, as one line: a malformed override (a sweep's too) and a
    run or sweep dir it cannot create (the default, outputs/ under the working directory, included)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ..hardware import writable_dir_problem

    words = [a for a in args if not a.startswith("-") and ("=" in a or a.startswith("~"))]  # not --cfg's "job"
    try:
        OverridesParser.create().parse_overrides(words)
    except Exception as e:  # noqa: BLE001 (Hydra's OverrideParseException and its grammar's errors)
        raise UserError(f"cannot parse the overrides: {str(e).strip().splitlines()[0]}",
                        "key=value, group=option, a sweep a,b,c; quote values with spaces or brackets.") from None
    dirs = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in words if w.startswith(("hydra.run.dir=", "hydra.sweep.dir="))}
    key = "hydra.sweep.dir" if "-m" in args or "--multirun" in args else "hydra.run.dir"
    target = dirs.get(key, "" if key in dirs else "outputs")
    if target and "${" not in target:
        why = writable_dir_problem(target)
        if why:
            raise UserError(f"{key}={target}: cannot create the run directory there ({why}).",
                            f"{key}=<a directory you can write to>, or run zerorun from a writable directory.",
                            key=key, value=target)

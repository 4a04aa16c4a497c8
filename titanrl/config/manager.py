"""Load a `JobConfig`: defaults, then a TOML file, then `--section.key=value` CLI overrides.

Every value is checked against its field's type annotation; an unknown section or key, a value of
the wrong type or outside a `Literal`'s choices raises `ValueError` naming the key, the value, the
allowed values and, for typos, the closest valid name.
"""

import ast
import dataclasses
import difflib
import inspect
import sys
import types
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import tomli

from titanrl.config.evaluation import EvalSuite
from titanrl.config.job_config import SUITES, JobConfig, section_fields

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}

# Keys that moved: the old name gets an error naming the new one (a config written for an older
# titanrl must not silently train with a default).
MOVED_KEYS = {
    "algorithm.normalize_std": "[algorithm.<name>] normalize_std (<name> = grpo, gspo, cispo or sapo)",
    "algorithm.gamma": "[algorithm.ppo] gamma or [algorithm.reinforce_pp] gamma",
    "algorithm.lam": "[algorithm.ppo] lam",
    "algorithm.sapo_tau_pos": "[algorithm.sapo] tau_pos",
    "algorithm.sapo_tau_neg": "[algorithm.sapo] tau_neg",
    "algorithm.dynamic_sampling": "[rollout] dynamic_sampling",
    "algorithm.max_sampling_rounds": "[rollout] max_sampling_rounds",
    "algorithm.overlong_filter": "[rollout] overlong_filter",
    "algorithm.overlong_buffer_len": "[reward] overlong_buffer_len",
    "algorithm.overlong_penalty_factor": "[reward] overlong_penalty_factor",
}


class CliValue(str):
    """A value given on the command line, kept as text until its type is known (the settings of
    an algorithm's own table are typed by the algorithm class, after loading)."""


def _did_you_mean(name: str, choices: list[str]) -> str:
    same_case_insensitive = [c for c in choices if c.lower() == name.lower()]
    close = same_case_insensitive or difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def section_types(section_cls: type) -> dict[str, Any]:
    return get_type_hints(section_cls)


def describe_type(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(tp))
    if _is_optional(tp):
        inner = [a for a in get_args(tp) if a is not type(None)][0]
        return f"{describe_type(inner)} or none"
    if get_origin(tp) is list:
        return f"list of {describe_type(get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def convert_value(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check `value` against annotation `tp`; CLI values arrive as strings and are parsed first."""

    def fail(reason: str = "") -> ValueError:
        return ValueError(f"Invalid value {value!r} for '{key}': expected {describe_type(tp)}{reason}")

    if _is_optional(tp):
        if value is None or (from_cli and isinstance(value, str) and value.lower() in _NONE):
            return None
        inner = [a for a in get_args(tp) if a is not type(None)][0]
        return convert_value(key, value, inner, from_cli)
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        hint = _did_you_mean(str(value), [str(c) for c in choices]) if isinstance(value, str) else ""
        raise fail("." + hint if hint else "")
    if get_origin(tp) is list:
        (elem_tp,) = get_args(tp)
        if from_cli and isinstance(value, str):
            # `--k=a,b` or Python's repr of a list (`--k=['a', 'b']`, what a round trip writes).
            items = [v.strip().strip("'\"") for v in value.strip("[]").split(",") if v.strip()]
        elif isinstance(value, list):
            items = value
        else:
            raise fail()
        return [convert_value(f"{key}[{i}]", v, elem_tp, from_cli) for i, v in enumerate(items)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise fail()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise fail() from None
        raise fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise fail() from None
        raise fail()
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail()
    raise TypeError(f"config field '{key}' has an unsupported annotation {tp!r}")


def apply_overrides(config: JobConfig, overrides: dict[str, dict[str, Any]], source: str, from_cli: bool) -> None:
    """Set `overrides[section][key]` on `config` after checking names and types."""
    sections = [f.name for f in dataclasses.fields(config)]
    for section_name, values in overrides.items():
        if section_name == SUITES:
            _apply_suites(config, values, source, from_cli)
            continue
        if section_name not in sections:
            raise ValueError(
                f"Unknown config section [{section_name}] in {source}.{_did_you_mean(section_name, sections)} "
                f"Valid sections: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ValueError(f"[{section_name}] in {source} must be a table of key = value, got {values!r}")
        section = getattr(config, section_name)
        for key, value in values.items():
            _set_key(section, section_name, key, value, source, from_cli)


def _set_key(section: Any, section_name: str, key: str, value: Any, source: str, from_cli: bool) -> None:
    field_types = section_types(type(section))
    tables = getattr(section, "tables", None) if "tables" in field_types else None
    name, dot, sub_key = key.partition(".")
    if tables is not None and (dot or isinstance(value, dict)):
        # A sub-table ([algorithm.sapo] in TOML, --algorithm.sapo.tau_pos on the CLI): kept as
        # given; the class that owns it types and validates it.
        table = tables.setdefault(name, {})
        if not dot:
            table.update(value)
        else:
            table[sub_key] = CliValue(value) if from_cli else value
        return
    if key not in field_types or key == "tables":
        moved = MOVED_KEYS.get(f"{section_name}.{key}")
        if moved:
            raise ValueError(f"'{section_name}.{key}' in {source} has moved: set {moved} instead")
        keys = [k for k in field_types if k != "tables"]
        raise ValueError(
            f"Unknown config key '{section_name}.{key}' in {source}.{_did_you_mean(key, keys)} "
            f"Valid keys of [{section_name}]: {', '.join(keys)}"
        )
    setattr(section, key, convert_value(f"{section_name}.{key}", value, field_types[key], from_cli))


def _apply_suites(config: JobConfig, values: Any, source: str, from_cli: bool) -> None:
    """TOML: `[[eval]]` tables replace the suites; the command line: `--eval.<suite>.key=value`
    changes a key of the suite of that name (checked again as a whole)."""
    if not from_cli:
        if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
            raise ValueError(
                f"'eval' in {source} must be an array of tables, one [[eval]] per suite (double brackets), "
                f"got {values!r}"
            )
        config.eval = [
            parse_table(EvalSuite, table, f"eval.{table.get('name') or i}") for i, table in enumerate(values)
        ]
        return
    changes: dict[str, dict[str, Any]] = {}
    names = [suite.name for suite in config.eval]
    for key, value in values.items():
        name, dot, field_name = key.partition(".")
        if not dot or not field_name:
            raise ValueError(f"Option '--eval.{key}' must name a suite and a key, e.g. --eval.gsm8k.k=8")
        if name not in names:
            known = ", ".join(names) if names else "none (declare suites as [[eval]] tables in the TOML file)"
            raise ValueError(
                f"Unknown eval suite '{name}' in '--eval.{key}'.{_did_you_mean(name, names)} Suites: {known}"
            )
        changes.setdefault(name, {})[field_name] = CliValue(value)
    for i, suite in enumerate(config.eval):
        if suite.name in changes:
            merged = {**dataclasses.asdict(suite), **changes[suite.name]}
            config.eval[i] = parse_table(EvalSuite, merged, f"eval.{suite.name}")


def parse_table(cls: type, values: dict[str, Any], table_name: str) -> Any:
    """An instance of the dataclass `cls` from a sub-table's raw values (TOML values, or
    `CliValue` text from the command line), with the same type checks and did-you-mean as a
    section; its `validate()` runs if it has one."""
    field_types = section_types(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in field_types:
            keys = list(field_types)
            valid = f"Valid keys: {', '.join(keys)}" if keys else "It takes no settings."
            raise ValueError(f"Unknown config key '{table_name}.{key}'.{_did_you_mean(key, keys)} {valid}")
        converted = convert_value(f"{table_name}.{key}", value, field_types[key], isinstance(value, CliValue))
        kwargs[key] = str(converted) if isinstance(converted, CliValue) else converted  # text is text now
    instance = cls(**kwargs)
    if hasattr(instance, "validate"):
        instance.validate()
    return instance


def parse_cli_args(args: list[str]) -> dict[str, dict[str, Any]]:
    """Parse `--section.key=value` / `--section.key value` into {section: {key: raw string}}.

    A bare `--section.key` followed by another option (or nothing) means 'true', for boolean flags.
    """
    overrides: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"Unexpected argument '{arg}': options look like --section.key=value")
        name, has_eq, value = arg[2:].partition("=")
        if not has_eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        section, dot, key = name.partition(".")
        if not dot or not section or not key:
            raise ValueError(f"Option '{arg}' must name a section and a key, e.g. --training.steps=10")
        overrides.setdefault(section, {})[key] = value
        i += 1
    return overrides


def load_toml(path: str) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            return tomli.load(f)
    except FileNotFoundError:
        raise ValueError(f"Config file '{path}' does not exist (given as --job.config_file)") from None
    except tomli.TOMLDecodeError as e:
        raise ValueError(f"Config file '{path}' is not valid TOML: {e}") from None


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Build the job config from defaults, the TOML named by --job.config_file, then the CLI."""
    argv = sys.argv[1:] if argv is None else argv
    cli = parse_cli_args(argv)
    config = JobConfig()
    config_file = cli.get("job", {}).get("config_file", "")
    if config_file:
        apply_overrides(config, load_toml(config_file), source=config_file, from_cli=False)
    apply_overrides(config, cli, source="the command line", from_cli=True)
    config.validate()
    return config


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, CliValue):  # command-line text not typed yet: a TOML value if it reads as one
        try:
            tomli.loads(f"v = {value}")
            return str(value)
        except tomli.TOMLDecodeError:
            value = str(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML that `load_config` reads back to an equal config."""
    lines = []
    for section_field in section_fields():
        lines.append(f"[{section_field.name}]")
        section = getattr(config, section_field.name)
        tables = {}
        for key, value in dataclasses.asdict(section).items():
            if key == "tables":
                tables = value
            elif value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
        for table_name, values in tables.items():
            lines.append(f"[{section_field.name}.{table_name}]")
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items() if value is not None)
            lines.append("")
    for suite in config.eval:
        lines.append(f"[[{SUITES}]]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in dataclasses.asdict(suite).items() if v is not None)
        lines.append("")
    return "\n".join(lines)


@cache
def field_docs(section_cls: type) -> dict[str, str]:
    """Docstrings written under each field of a config dataclass (read from its source), inherited
    fields included: each is documented in the dataclass that declares it (an algorithm's
    `Settings` may extend its parent's)."""
    docs = {}
    for base in reversed(section_cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    tree = ast.parse(inspect.getsource(section_cls))
    cls_def = tree.body[0]
    assert isinstance(cls_def, ast.ClassDef)
    body = cls_def.body
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = nxt.value.value
    return docs


def help_text() -> str:
    """Every option with its type, default and docstring, for `--help`."""
    config = JobConfig()
    lines = ["titanrl options (TOML section.key; on the CLI: --section.key=value)", ""]
    for section_field in section_fields():
        section = getattr(config, section_field.name)
        docs = field_docs(type(section))  # type: ignore[arg-type]  # a class is hashable
        lines.append(f"[{section_field.name}]")
        for key, tp in section_types(type(section)).items():
            if key == "tables":
                lines.append(f"  [{section_field.name}.<name>]  {docs.get(key, '')}")
                continue
            lines.append(f"  --{section_field.name}.{key}  ({describe_type(tp)}, default {getattr(section, key)!r})")
            lines.append(f"      {docs.get(key, '')}")
        lines.append("")
    return "\n".join(lines + _suite_help())


def _suite_help() -> list[str]:
    suite, docs = EvalSuite(), field_docs(EvalSuite)
    lines = [f"[[{SUITES}]]  evaluation suites, one table each (docs/evaluation.md); --{SUITES}.<suite name>.key=value"]
    for key, tp in section_types(EvalSuite).items():
        lines.append(f"  {key}  ({describe_type(tp)}, default {getattr(suite, key)!r})")
        lines.append(f"      {docs.get(key, '')}")
    return lines

"""Loading a job: TOML files (with ``extends``) and ``--section.key value`` overrides, typed
against the schema, and the ``--help`` text made from the schema's field docstrings.

A file may name a base file with a top-level ``extends = "base.toml"`` (relative to itself); the
base is loaded first and the file's keys win. Every problem (unknown section or key, wrong type,
bad TOML, a missing file) raises ``ConfigError`` naming the file, the key and a fix.

A CP style's options are keys of ``[parallelism]`` declared by the style
(``schema.StyleOptionValues``): read, typed and listed by ``--help`` like the section's own. An
option that a base file set for its own ``cp_style`` is dropped when a file extending it names a
style that does not take it (``_drop_other_styles_options``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Literal

from upipe_dtensor.config.schema import ConfigError, JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


OVERRIDES_HELP = (
    "--config FILE.toml names the job file. Any --section.key value (or --section.key=value)\n"
    "after it overrides that key of the file, e.g.\n"
    "    --config train_configs/debug_model.toml --parallelism.cp_style ulysses\n"
    "python train.py --help lists every section and key."
)
"""How every command's ``--help`` explains the job file and its overrides (one wording)."""


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(JobConfig)
        if dataclasses.is_dataclass(hints[f.name])
    }


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _option_table(section_cls: type) -> str | None:
    """The field of ``section_cls`` that holds keys declared elsewhere (a ``declarations()``
    table: ``[parallelism]``'s style options), or None."""
    types = _field_types(section_cls)
    return next((f.name for f in dataclasses.fields(section_cls) if _declares(types[f.name])), None)


def _declares(annotation: Any) -> bool:
    return callable(getattr(annotation, "declarations", None))


def _keys(section_cls: type) -> dict[str, Any]:
    """A section's keys and their types: its fields, with a table of declared keys replaced by
    those keys (each style's options, in ``[parallelism]``)."""
    keys = _field_types(section_cls)
    table = _option_table(section_cls)
    if table is not None:
        return {**{k: v for k, v in keys.items() if k != table}, **keys[table].types()}
    return keys


def _section(section_cls: type, values: dict[str, Any]) -> Any:
    """The section from its keys' values, the declared keys gathered into their table."""
    table = _option_table(section_cls)
    if table is None:
        return section_cls(**values)
    declared = _field_types(section_cls)[table]
    options = {key: values.pop(key) for key in list(values) if key in declared.types()}
    return section_cls(**values, **{table: declared(options)})


def _table_type(annotation: Any) -> type | None:
    """The item class of a ``list[Dataclass]`` field, an array of tables (``[[section.key]]``
    in TOML, e.g. ``[[training.sources]]``); None for any other field."""
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if dataclasses.is_dataclass(item):
            return item
    return None


def _read_tables(value: Any, item_cls: type, shown: str, name: str) -> list[Any]:
    """The ``[[name]]`` tables of a file as ``item_cls`` values, each key checked as a section's
    keys are: an unknown key or a wrong type names the table by its number."""
    if not isinstance(value, list) or not all(isinstance(table, dict) for table in value):
        section, key = name.split(".")
        raise ConfigError(
            f"{shown}: [{section}] {key} = {value!r} should be [[{name}]] tables, one per item; "
            f"their keys: {sorted(_field_types(item_cls))}"
        )
    known = _field_types(item_cls)
    items = []
    for number, table in enumerate(value, 1):
        label = f"[[{name}]] #{number}"
        for key in table:
            if key not in known:
                raise ConfigError(
                    f"{shown}: unknown key {label} {key}; known keys of [[{name}]]: {sorted(known)}"
                )
        items.append(
            item_cls(
                **{
                    key: _coerce(item, known[key], f"{shown}: {label} {key}")
                    for key, item in table.items()
                }
            )
        )
    return items


def _shown(path: Path) -> str:
    """A path as the user would write it: relative to the working directory when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _from_text(value: str, annotation: Any) -> Any:
    """A command-line string converted to the field's type, or the string if it does not convert."""
    if annotation is bool and value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        if annotation is kind:
            try:
                return kind(value.replace("_", "")) if kind is int else kind(value)
            except ValueError:
                return value
    optional = typing.get_args(annotation)
    if optional and type(None) in optional and typing.get_origin(annotation) is not Literal:
        inner = next(a for a in optional if a is not type(None))
        return None if value in ("none", "None") else _from_text(value, inner)
    return value


def _choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values a field allows: a Literal's, or those a class such as ``CpStyle`` (names
    registered at run time) lists; None for a field of any value of its type."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    choices = getattr(annotation, "choices", None)
    return choices() if callable(choices) else None


def _coerce(value: Any, annotation: Any, where: str, *, from_text: bool = False) -> Any:
    """Check ``value`` against a field's annotation. Only command-line strings (``from_text``) are
    converted: in a TOML file ``seq_len = "256"`` is a string, and TOML has typed values for
    that."""
    if from_text:
        value = _from_text(value, annotation)
    choices = _choices(annotation)
    if choices is not None:
        if value not in choices:
            raise ConfigError(f"{where} = {value!r} is not one of {list(choices)}")
        return value
    optional = typing.get_args(annotation)
    if optional and type(None) in optional:  # X | None
        if value is None:
            return None
        annotation = next(a for a in optional if a is not type(None))
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is str and isinstance(value, str):
        return value
    type_name = getattr(annotation, "__name__", str(annotation))
    fix = "; write it without quotes" if isinstance(value, str) and not from_text else ""
    raise ConfigError(f"{where} = {value!r} should be of type {type_name}{fix}")


def _read_text(path: Path, shown: str) -> str:
    """A job file's text: TOML is UTF-8, so another encoding (a UTF-16 file, as some Windows
    editors save) or an unreadable file is a ``ConfigError`` naming the fix."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(
            f"{shown} cannot be read ({err.strerror or err}); fix its permissions or pass another "
            "--config"
        ) from err
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
            found, fix = "UTF-16 text", f"e.g. iconv -f UTF-16 -t UTF-8 {path.name} > new.toml"
        else:
            found = f"not UTF-8 text (byte {err.start:,} is {data[err.start]:#04x})"
            fix = "in your editor"
        raise ConfigError(
            f"{shown} is {found}, but TOML is UTF-8: save it as UTF-8 ({fix})"
        ) from err


def _read_toml(
    path: Path, seen: tuple[Path, ...] = (), extended_by: str = ""
) -> tuple[dict[str, dict[str, Any]], dict[str, str], list[str]]:
    """The file's sections merged over its ``extends`` chain (base first), the file that set
    each ``"section.key"``, and the chain's files (base first). ``extended_by`` names the file
    whose ``extends`` pointed here."""
    shown = _shown(path)
    if not path.is_file():
        if path.is_dir():
            tomls = sorted(_shown(p) for p in path.glob("*.toml"))[:5]
            example = f", e.g. {', '.join(tomls)}" if tomls else ""
            raise ConfigError(
                f"{extended_by}config file {shown} is a folder; pass a .toml job file{example}"
            )
        fix = (
            "fix the path (relative to that file)"
            if extended_by
            else "pass --config PATH to a .toml job file"
        )
        raise ConfigError(f"{extended_by}config file {shown} does not exist; {fix}")
    if path in seen:
        raise ConfigError(f"{shown}: 'extends' cycle through {' -> '.join(map(_shown, seen))}")
    try:
        raw = tomllib.loads(_read_text(path, f"{extended_by}config file {shown}"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{shown}: invalid TOML: {err}") from err
    merged: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    files: list[str] = []
    base = raw.pop("extends", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{shown}: extends = {base!r} should be a path string")
        merged, sources, files = _read_toml(
            (path.parent / base).resolve(), seen + (path,), f"{shown}: extends = {base!r}, but the "
        )
    sections = _sections()
    for name, table in raw.items():
        if name not in sections:
            raise ConfigError(
                f"{shown}: unknown section [{name}]; known sections: {sorted(sections)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{shown}: '{name}' must be a [{name}] table, not a value")
        known = _keys(sections[name])
        for key, value in table.items():
            if key not in known:
                raise _unknown_key(shown, name, key, known)
            item_cls = _table_type(known[key])
            merged.setdefault(name, {})[key] = (
                _read_tables(value, item_cls, shown, f"{name}.{key}")
                if item_cls
                else _coerce(value, known[key], f"{shown}: [{name}] {key}")
            )
            sources[f"{name}.{key}"] = shown
    return merged, sources, [*files, shown]


RENAMED_KEYS = {("parallelism", "fpdt_chunk_tokens"): "chunk_tokens"}
"""Keys that were renamed, (section, old key) -> new key: a job that writes the old one is told
the new one, in one line (the meaning is the same, and unset is leaving the key out)."""


def _unknown_key(where: str, section: str, key: str, known) -> ConfigError:
    renamed = RENAMED_KEYS.get((section, key))
    if renamed is not None:
        return ConfigError(
            f"{where}: [{section}] {key} is now {renamed} (the same meaning; leave it out for "
            f"none): rename it"
        )
    return ConfigError(
        f"{where}: unknown key [{section}] {key}; known keys of [{section}]: {sorted(known)}"
    )


def _parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """``--section.key value`` (or ``--section.key=value``) pairs, typed against the dataclasses."""
    overrides: dict[str, dict[str, Any]] = {}
    sections = _sections()
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"command line: expected --section.key value, got {arg!r}; "
                "sections and keys are listed by --help"
            )
        name_key, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: {arg} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        section, _, key = name_key.partition(".")
        if section not in sections:
            raise ConfigError(
                f"command line: unknown section in --{name_key}; known: {sorted(sections)}"
            )
        known = _keys(sections[section])
        if key not in known:
            if (section, key) in RENAMED_KEYS:
                raise _unknown_key("command line", section, key, known)
            raise ConfigError(
                f"command line: unknown key --{name_key}; known keys of [{section}]: "
                f"{sorted(known)}"
            )
        if _table_type(known[key]):
            raise ConfigError(
                f"command line: --{name_key} takes [[{name_key}]] tables, which only a job file "
                f"can hold; write them in the --config file (or a file it extends)"
            )
        overrides.setdefault(section, {})[key] = _coerce(
            value, known[key], f"command line: --{name_key}", from_text=True
        )
    return overrides


def load_config(config_file: str | None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults <- the TOML file (and its bases) <- command-line overrides; validated types."""
    values: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    files: list[str] = []
    if config_file is not None:
        values, sources, files = _read_toml(Path(config_file).resolve())
    for section, table in _parse_overrides(overrides or []).items():
        values.setdefault(section, {}).update(table)
        sources.update({f"{section}.{key}": "command line" for key in table})
    sections = _sections()
    config = JobConfig(
        **{name: _section(sections[name], values.get(name, {})) for name in sections},
        config_file=config_file,
        sources=sources,
        files=files,
    )
    return _drop_other_styles_options(config)


def _drop_other_styles_options(config: JobConfig) -> JobConfig:
    """``config`` without the style options that a base file set for its own ``cp_style`` and a
    file extending it (or the command line) replaced with a style that does not take them: a
    baseline recipe that extends a UPipe recipe with another style need not unset UPipe's
    options. An option set where cp_style is set, or after it, stays (and ``check_job`` refuses
    it if the style does not take it)."""
    parallelism = config.parallelism
    if "parallelism.cp_style" not in config.sources:
        return config
    spec = parallelism.style
    dropped = [
        key
        for key in parallelism.style_options
        if not spec.takes(key)
        and not config.set_after(f"parallelism.{key}", "parallelism.cp_style")
    ]
    for key in dropped:
        del config.sources[f"parallelism.{key}"]
    return config.with_values({f"parallelism.{key}": None for key in dropped})


def parse_args(argv: list[str]) -> JobConfig:
    """``--config FILE.toml`` (optional: defaults otherwise) and any ``--section.key value``
    overrides."""
    config_file = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("command line: --config needs a path to a .toml job file")
            config_file, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            config_file, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    return load_config(config_file, rest)


def _field_docs(section_cls: type) -> dict[str, str]:
    """The docstring under each field of a section, its dataclass bases' included (Python keeps
    none at run time: read the source)."""
    docs = {}
    for cls in reversed(section_cls.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
            ):
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def _help_lines(cls: type, prefix: str, indent: int) -> list[str]:
    """``cls``'s keys as ``{prefix}key (type, default)`` lines, each with its docstring under it;
    the keys of an array of tables (``[[section.key]]``) are listed under the table's name."""
    lines = []
    docs = _field_docs(cls)
    pad = " " * indent
    for f in dataclasses.fields(cls):
        annotation = _field_types(cls)[f.name]
        if _declares(annotation):
            for heading, declaring in annotation.declarations().items():
                lines.append(f"{pad}{heading}:")
                own = _help_lines(declaring, prefix, indent + 2)
                lines += own or [f"{pad}    (none of its own)"]
            continue
        item_cls = _table_type(annotation)
        if item_cls:
            name = f"{prefix.lstrip('-')}{f.name}"
            lines.append(f"{pad}[[{name}]] (tables, only in a job file; none by default), keys:")
        else:
            choices = _choices(annotation)
            kind = (
                " | ".join(map(repr, choices))
                if choices is not None
                else getattr(annotation, "__name__", str(annotation))
            )
            lines.append(f"{pad}{prefix}{f.name} ({kind}, default {f.default!r})")
        if f.name in docs:
            lines.append(
                textwrap.fill(
                    docs[f.name], 100, initial_indent=pad + " " * 4, subsequent_indent=pad + " " * 4
                )
            )
        if item_cls:
            lines += _help_lines(item_cls, "", indent + 4)
    return lines


def config_help() -> str:
    """Every ``--section.key`` with its type, default and docstring, for ``train.py --help``."""
    lines = []
    for name, section_cls in _sections().items():
        lines.append(f"[{name}]")
        lines += _help_lines(section_cls, f"--{name}.", 2)
    return "\n".join(lines)

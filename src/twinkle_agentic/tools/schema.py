"""``validate_arguments``: check a tool call's arguments against the tool's JSON schema.

The subset of JSON Schema that tool specs use: ``type`` (one or a list), ``properties``,
``required``, ``additionalProperties: false``, ``enum``, ``items``, ``minimum``/``maximum``,
``minLength``/``maxLength``. Other keywords are not checked. It is written here rather than
taken from ``jsonschema`` so the package needs nothing beyond ``twinkle``, and so each failure is
one short sentence a model can act on."""

from typing import Any

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}


def _is(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False  # JSON's true is not a number
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    expected = _TYPES.get(kind)
    return True if expected is None else isinstance(value, expected)


def validate_arguments(value: Any, schema: dict[str, Any] | None, where: str = "arguments") -> str | None:
    """``None`` when ``value`` satisfies ``schema``, else the first problem as one sentence."""
    if not schema:
        return None
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_is(value, k) for k in kinds):
            return f"{where} must be {' or '.join(kinds)}, got {type(value).__name__} {value!r:.60}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {value!r:.60}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            return f"{where} must be >= {schema['minimum']}, got {value}"
        if "maximum" in schema and value > schema["maximum"]:
            return f"{where} must be <= {schema['maximum']}, got {value}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return f"{where} must have at least {schema['minLength']} characters"
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            return f"{where} must have at most {schema['maxLength']} characters"
    if isinstance(value, dict):
        return _object(value, schema, where)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = validate_arguments(item, schema["items"], f"{where}[{i}]")
            if problem:
                return problem
    return None


def _object(value: dict[str, Any], schema: dict[str, Any], where: str) -> str | None:
    properties = schema.get("properties") or {}
    missing = [k for k in schema.get("required", []) if k not in value]
    if missing:
        return f"{where} lack the required {', '.join(repr(k) for k in missing)}"
    if schema.get("additionalProperties") is False:
        extra = sorted(set(value) - set(properties))
        if extra:
            return f"{where} have unknown {', '.join(repr(k) for k in extra)}; known: {', '.join(properties)}"
    for key, sub in properties.items():
        if key in value and isinstance(sub, dict):
            problem = validate_arguments(value[key], sub, f"argument {key!r}")
            if problem:
                return problem
    return None

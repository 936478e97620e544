"""A tool's parameters schema as the grammar of a forced call enforces it: objects closed where the schema leaves
`additionalProperties` unset.

JSON schema allows any extra property by default, and a grammar that allows them lets a small model go on writing
invented keys until max_tokens cuts the arguments off, unparsable. A function takes the parameters it declares;
OpenAI's strict mode and vLLM's default grammar backend (xgrammar's strict mode) close objects the same way. A
schema that says `additionalProperties` itself keeps what it says.
"""

from __future__ import annotations

# Keys whose value is one subschema, and keys whose value is a list or a map of them. allOf is left out on
# purpose: its members are parts of one object, and closing each would forbid the properties of the others.
_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: object) -> object:
    """A copy of `schema` with every object subschema that declares properties closed; the input is untouched."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if _is_object(out) and not any(
        k in out for k in ("additionalProperties", "unevaluatedProperties", "allOf")
    ):
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    declared = kind == "object" or (isinstance(kind, list) and "object" in kind)
    return "properties" in schema and (declared or kind is None)

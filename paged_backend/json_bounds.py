"""JSON schemas rewritten so that nothing inside a JSON value can run on without end.

A small model that loops on digits or whitespace would otherwise write until `max_tokens`, and
the budget guard would then have to cut a value short. The grammar itself ends such runs:
- numbers: at most `MAX_INTEGER_DIGITS` digits before the point and `MAX_FRACTION_DIGITS`
  after it, no exponent (a double holds ~15 significant digits; longer runs are a model
  looping). A schema's own bounds win where they are tighter, or lie wholly beyond these;
- whitespace: at most `MAX_WHITESPACE_RUN` characters between two tokens (room for
  pretty-printing a few levels deep), none beyond the separators `", "` and `": "` in compact
  mode;
- values a schema leaves open (`{}`, `true`, an object's extra properties, an array's items)
  are any JSON value with the same bounds, and an object that lists its properties has no
  others unless it says so (xgrammar's and OpenAI's strict reading, which vLLM keeps).
"""

from __future__ import annotations

import copy
from typing import Any

MAX_WHITESPACE_RUN = 12
MAX_INTEGER_DIGITS = 15
MAX_FRACTION_DIGITS = 10  # llguidance takes `multipleOf` down to 1e-10 exactly

_LIMIT = 10**MAX_INTEGER_DIGITS - 1
_MIN_WIDTH = 1e-6
_ANY_NAME = "paged_backend_any_value"
_ANY = {"$ref": f"#/$defs/{_ANY_NAME}"}
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
    "writeOnly", "$id", "$schema", "$anchor",
}  # fmt: skip
# Keywords whose value is a schema, a list of schemas or a name -> schema map.
_ONE = ("additionalProperties", "additionalItems", "items", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def compile_options(compact: bool) -> dict[str, Any]:
    """llguidance's JSON options for the whitespace bounds."""
    options: dict[str, Any] = {"coerce_one_of": True, "lenient": True}
    if compact:
        return options | {"whitespace_flexible": False, "item_separator": ", ",
                          "key_separator": ": "}  # fmt: skip
    return options | {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE_RUN}}}"}


def bounded_schema(schema: dict) -> dict:
    """A copy of `schema` whose numbers and open values are bounded (see the module doc)."""
    root = _bound(copy.deepcopy(schema))
    if not isinstance(root, dict):
        root = {"allOf": [root]}
    defs = root.setdefault("$defs", {})
    defs[_ANY_NAME] = _any_value()
    return root


def _any_value() -> dict:
    return {
        "anyOf": [
            {"type": ["null", "boolean", "string"]},
            _bound_number({"type": "number"}),
            {"type": "array", "items": _ANY},
            {"type": "object", "additionalProperties": _ANY},
        ]
    }


def _bound(node: Any) -> Any:
    if node is True or (isinstance(node, dict) and set(node) <= _ANNOTATIONS):
        return dict(_ANY)
    if not isinstance(node, dict):
        return node
    for key in _ONE:
        if key in node:
            node[key] = _bound(node[key])
    for key in _LIST:
        if isinstance(node.get(key), list):
            node[key] = [_bound(s) for s in node[key]]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            node[key] = {name: _bound(s) for name, s in node[key].items()}
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
    if "object" in types and "additionalProperties" not in node:
        closed = "properties" in node or "patternProperties" in node
        node["additionalProperties"] = False if closed else dict(_ANY)
    if "array" in types and "items" not in node:
        node["items"] = False if "prefixItems" in node else dict(_ANY)
    if types & {"number", "integer"}:
        _bound_number(node)
    return node


def _bound_number(node: dict) -> dict:
    low, high = node.get("minimum"), node.get("maximum")
    if (low is not None and low > _LIMIT) or (high is not None and high < -_LIMIT):
        return node  # the schema asks for numbers beyond the bound: its own range stands
    node["minimum"] = low = -_LIMIT if low is None else max(low, -_LIMIT)
    node["maximum"] = high = _LIMIT if high is None else min(high, _LIMIT)
    types = node["type"]
    # A range narrower than this pins the value already; llguidance checks `multipleOf` against
    # it in binary floating point, and [32.12, 32.12] would hold no multiple of 1e-10.
    number = "number" in ([types] if isinstance(types, str) else types)
    if number and "multipleOf" not in node and high - low > _MIN_WIDTH:
        node["multipleOf"] = 10.0**-MAX_FRACTION_DIGITS
    return node

"""The grammar texts compiled from a request's spec: JSON schemas (with two xgrammar gaps
closed) and structural tags (their JSON schemas turned into the same JSON grammar)."""

from __future__ import annotations

import json
from typing import Any

# Two gaps in xgrammar <= 0.2.9's JSON strings, closed by rewriting the schema's EBNF:
# - a string with minLength/maxLength is a repeat of a class that lets raw control characters
#   (invalid JSON) through and has no escapes (mlc-ai/xgrammar#800): each repeat becomes one
#   JSON character instead;
# - over a byte-level vocabulary its classes take UTF-8-encoded surrogates (ED A0 80), which no
#   UTF-8 decoder reads as text (three U+FFFD: a maxLength broken, text not what was matched).
_NO_SURROGATE = r"\uD800-\uDFFF"
_STRING_CHAR_FIXES = (
    (r'[^\"\\\r\n]', r'([^\0-\x1f\"\\' + _NO_SURROGATE + r'] | ("\\" [\"\\/bfnrt]))'),
    (r'[^\0-\x1f\"\\\r\n]', r'[^\0-\x1f\"\\\r\n' + _NO_SURROGATE + "]"),
)


def json_grammar(schema: str) -> str:
    """The EBNF of `schema`: compact JSON (a model cannot pad it with endless spaces), every
    string character valid JSON and UTF-8 (see _STRING_CHAR_FIXES). Raises what xgrammar raises."""
    import xgrammar as xgr  # on first use, as in device/grammar.py

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    for wrong, right in _STRING_CHAR_FIXES:
        text = text.replace(wrong, right)
    return text


def structural_tag(source: str) -> str:
    """A structural tag's JSON with each `json_schema` element replaced by our JSON grammar."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and "json_schema" in node:
            schema = json.dumps(node["json_schema"], sort_keys=True)
            return {"type": "grammar", "grammar": json_grammar(schema)}
        return {key: walk(value) for key, value in node.items()}

    return json.dumps(walk(json.loads(source)))

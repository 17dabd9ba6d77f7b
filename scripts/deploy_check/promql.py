"""PromQL sanity without Prometheus: tokens, brackets, functions, range vectors, metric names.

Not a full parser. It catches what breaks dashboards and alerts in practice: unbalanced
brackets, unknown functions, bad durations, `rate()` over a gauge, `histogram_quantile` without
`_bucket` or without `le` kept by its aggregation, label names a metric does not have, and it
collects every metric name an expression reads (to check them against what the daemon exports).
Grafana variables (`$__rate_interval`, `$pool`) are accepted where a duration or value may stand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


FUNCTIONS = _words(
    "abs absent absent_over_time avg_over_time ceil changes clamp clamp_max clamp_min "
    "count_over_time day_of_month day_of_week delta deriv exp floor histogram_quantile "
    "histogram_count histogram_sum holt_winters idelta increase irate label_join label_replace "
    "last_over_time ln log10 log2 max_over_time min_over_time predict_linear quantile_over_time "
    "rate resets round scalar sgn sort sort_desc sqrt stddev_over_time sum_over_time time "
    "timestamp vector present_over_time")
AGGREGATIONS = _words(
    "sum avg min max count stddev stdvar topk bottomk quantile count_values group")
KEYWORDS = _words("and or unless bool offset")
LABEL_LISTS = _words("by without on ignoring group_left group_right")
COUNTER_FUNCS = frozenset({"rate", "irate", "increase", "resets"})
COUNTER_SUFFIXES = ("_total", "_bucket", "_sum", "_count")
# Labels Prometheus attaches to every scraped series (job, instance) or Kubernetes SD adds.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "service"})
_DURATION = r"\d+(?:ms|s|m|h|d|w|y)(?:\d+(?:ms|s|m|h|d|w|y))*"
_RANGE_BODY = re.compile(rf"^(?:{_DURATION}|\$\w+)(?::(?:{_DURATION}|\$\w+)?)?$")
_TOKEN = re.compile(
    rf"""(?P<ws>\s+)
    |(?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
    |(?P<range>\[[^\]]*\])
    |(?P<dur>{_DURATION}(?![\w.]))
    |(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    |(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    |(?P<var>\$\w+)
    |(?P<op>==|!=|=~|!~|>=|<=|[-+*/%^<>=(){{}},])""",
    re.X,
)


@dataclass
class Analysis:
    """What one expression reads: metric names (with their label names) and the problems."""

    metrics: dict[str, set[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def tokenize(expr: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(kind, text) tokens without whitespace, and problems for characters that fit no token."""
    tokens, problems, pos = [], [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            problems.append(f"unexpected {expr[pos]!r} at {pos}")
            pos += 1
            continue
        if m.lastgroup != "ws":
            tokens.append((str(m.lastgroup), m.group()))
        pos = m.end()
    return tokens, problems


def analyse(expr: str) -> Analysis:
    """Check one PromQL expression; see the module docstring for what is checked."""
    tokens, problems = tokenize(expr)
    out = Analysis(problems=problems)
    if not tokens:
        out.problems.append("empty expression")
        return out
    _check_brackets(tokens, out)
    _walk(tokens, out)
    return out


def _check_brackets(tokens: list[tuple[str, str]], out: Analysis) -> None:
    pairs, stack = {")": "(", "}": "{"}, []
    for kind, text in tokens:
        if kind == "range" and not _RANGE_BODY.match(text[1:-1]):
            out.problems.append(f"bad range {text}")
        if kind != "op":
            continue
        if text in "({":
            stack.append(text)
        elif text in pairs and (not stack or stack.pop() != pairs[text]):
            out.problems.append(f"unbalanced {text!r}")
    if stack:
        out.problems.append(f"unclosed {''.join(stack)!r}")


def _walk(tokens: list[tuple[str, str]], out: Analysis) -> None:
    calls: list[str] = []  # enclosing function per open "(" ("" for plain grouping)
    grouping: list[list[str]] = []  # label lists of the aggregations seen so far
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "ident" and text in LABEL_LISTS and nxt == "(":
            close = _index_of(tokens, ")", i + 2)
            grouping.append([t for k, t in tokens[i + 2 : close] if k == "ident"])
            i = close + 1
            continue
        if kind == "ident" and nxt == "(":
            if text not in FUNCTIONS | AGGREGATIONS:
                out.problems.append(f"unknown function {text}()")
            calls.append(text)
            i += 2
            continue
        if kind == "ident" and text in AGGREGATIONS and nxt in LABEL_LISTS:
            i += 1
            continue
        if kind == "op" and text == "(":
            calls.append("")
        elif kind == "op" and text == ")" and calls:
            _close_call(calls.pop(), tokens, i, grouping, out)
        elif kind == "ident" and text not in KEYWORDS and text.lower() not in ("inf", "nan"):
            i = _metric(tokens, i, calls, out)
            continue
        i += 1


def _metric(tokens: list[tuple[str, str]], i: int, calls: list[str], out: Analysis) -> int:
    """Record the metric selector starting at tokens[i]; return the index after it."""
    name = tokens[i][1]
    labels = out.metrics.setdefault(name, set())
    j = i + 1
    if j < len(tokens) and tokens[j][1] == "{":
        close = _index_of(tokens, "}", j)
        labels.update(t for k, t in tokens[j + 1 : close] if k == "ident")
        j = close + 1
    has_range = j < len(tokens) and tokens[j][0] == "range"
    func = next((c for c in reversed(calls) if c), "")
    if has_range and func in COUNTER_FUNCS and not name.endswith(COUNTER_SUFFIXES):
        out.problems.append(f"{func}() over {name}, which is not a counter")
    if not has_range and func in COUNTER_FUNCS and calls and calls[-1] == func:
        out.problems.append(f"{func}({name}) needs a range, e.g. [5m]")
    return j + 1 if has_range else j


def _close_call(func: str, tokens: list[tuple[str, str]], i: int,
                grouping: list[list[str]], out: Analysis) -> None:
    if func != "histogram_quantile":
        return
    start = _matching_open(tokens, i)
    inner = [t for k, t in tokens[start:i] if k == "ident"]
    if not any(t.endswith("_bucket") for t in inner):
        out.problems.append("histogram_quantile() reads no *_bucket series")
    aggregated = any(t in AGGREGATIONS for t in inner)
    if aggregated and not any("le" in labels for labels in grouping):
        out.problems.append("histogram_quantile() over an aggregation that drops `le`")


def _index_of(tokens: list[tuple[str, str]], text: str, start: int) -> int:
    for j in range(start, len(tokens)):
        if tokens[j][1] == text:
            return j
    return len(tokens) - 1


def _matching_open(tokens: list[tuple[str, str]], close: int) -> int:
    depth = 0
    for j in range(close, -1, -1):
        if tokens[j][1] == ")":
            depth += 1
        elif tokens[j][1] == "(":
            depth -= 1
            if depth == 0:
                return j
    return 0

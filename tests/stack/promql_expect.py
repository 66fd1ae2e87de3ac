"""What a PromQL expression of examples/ should return, computed from kvmiss's own counters.

The end-to-end test scrapes every replica's /metrics at the moment Prometheus starts (S0) and
after the traffic (S1), then runs each shipped expression in the real Prometheus and here, on
the counters' increase S1 - S0 (gauges: their S1 value). Prometheus has existed for less than
every range in the expressions, so ``increase(x[w])`` is that increase and ``rate(x[w])`` is
it over w (up to Prometheus's extrapolation at the edges: the caller's tolerance).

The grammar is the part of PromQL the shipped expressions use: selectors with matchers,
rate/increase over a range, sum/max/min [by (...)], histogram_quantile, + - * /, and the
comparisons (filtering, as in PromQL without ``bool``), one-to-one matching on equal labels.
"""

from __future__ import annotations

import math
import re

Vector = dict[frozenset, float]
DURATION = {"s": 1, "m": 60, "h": 3600}
TOKEN = re.compile(r'\s*(?:(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?![\w])|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
                   r'|(?P<str>"(?:[^"\\]|\\.)*")|(?P<range>\[\d+[smh]\])|(?P<op>==|!=|>=|<=|=~|!~|[-+*/(){},=<>]))')


def tokenize(expr: str) -> list[tuple[str, str]]:
    expr = re.sub(r"#[^\n]*", " ", expr)
    out, pos = [], 0
    while pos < len(expr.rstrip()):
        match = TOKEN.match(expr, pos)
        assert match, f"cannot read PromQL at {expr[pos:pos + 30]!r}"
        kind = match.lastgroup
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


class Samples:
    """(metric name, labels, value) triples: counters as increases, gauges as values."""

    def __init__(self, samples: list[tuple[str, dict, float]]):
        self.samples = samples

    def select(self, name: str, matchers: list[tuple[str, str, str]]) -> Vector:
        out: Vector = {}
        for n, labels, value in self.samples:
            if n != name:
                continue
            if all(_matches(labels.get(k, ""), op, v) for k, op, v in matchers):
                key = frozenset(labels.items())
                out[key] = out.get(key, 0.0) + value
        return out


def _matches(value: str, op: str, pattern: str) -> bool:
    return {"=": value == pattern, "!=": value != pattern,
            "=~": re.fullmatch(pattern, value) is not None, "!~": re.fullmatch(pattern, value) is None}[op]


class Evaluator:
    def __init__(self, samples: Samples):
        self.samples = samples

    def evaluate(self, expr: str) -> float | Vector:
        self.tokens, self.pos = tokenize(expr), 0
        value = self.comparison()
        assert self.pos == len(self.tokens), f"unread PromQL: {self.tokens[self.pos:]}"
        return value

    # --- the parser, evaluating as it goes ---
    def peek(self, k: int = 0) -> tuple[str, str]:
        return self.tokens[self.pos + k] if self.pos + k < len(self.tokens) else ("end", "")

    def take(self, text: str | None = None) -> str:
        kind, value = self.peek()
        assert text is None or value == text, f"expected {text!r}, found {value!r}"
        self.pos += 1
        return value

    def comparison(self):
        left = self.additive()
        while self.peek()[1] in (">", "<", "==", "!=", ">=", "<="):
            op = self.take()
            left = _binary(op, left, self.additive())
        return left

    def additive(self):
        left = self.multiplicative()
        while self.peek()[1] in ("+", "-"):
            op = self.take()
            left = _binary(op, left, self.multiplicative())
        return left

    def multiplicative(self):
        left = self.unary()
        while self.peek()[1] in ("*", "/"):
            op = self.take()
            left = _binary(op, left, self.unary())
        return left

    def unary(self):
        kind, value = self.peek()
        if kind == "num":
            self.take()
            return float(value)
        if value == "(":
            self.take("(")
            inner = self.comparison()
            self.take(")")
            return inner
        assert kind == "name", f"unexpected {value!r}"
        if value in ("sum", "max", "min"):
            return self.aggregation()
        if value in ("rate", "increase"):
            self.take()
            self.take("(")
            name, matchers = self.selector()
            kind, window = self.peek()
            assert kind == "range", f"{value} needs a range, found {window!r}"
            self.take()
            self.take(")")
            seconds = int(window[1:-2]) * DURATION[window[-2]]
            increases = self.samples.select(name, matchers)
            return {_drop_name(k): v / (seconds if value == "rate" else 1) for k, v in increases.items()}
        if value == "histogram_quantile":
            self.take()
            self.take("(")
            q = float(self.take())
            self.take(",")
            buckets = self.comparison()
            self.take(")")
            return histogram_quantile(q, buckets)
        name, matchers = self.selector()
        return {frozenset(k): v for k, v in self.samples.select(name, matchers).items()}

    def selector(self) -> tuple[str, list[tuple[str, str, str]]]:
        name = self.take()
        matchers = []
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label, op, value = self.take(), self.take(), self.take()
                matchers.append((label, op, value[1:-1].encode().decode("unicode_escape")))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        return name, matchers

    def aggregation(self) -> Vector:
        op = self.take()
        by = None
        if self.peek()[1] == "by":
            by = self.labels()
        self.take("(")
        inner = self.comparison()
        self.take(")")
        if self.peek()[1] == "by":
            by = self.labels()
        assert isinstance(inner, dict), f"{op} of a scalar"
        groups: dict[frozenset, list[float]] = {}
        for key, value in inner.items():
            labels = dict(key)
            group = frozenset((k, labels.get(k, "")) for k in (by or []) if labels.get(k, ""))
            groups.setdefault(group, []).append(value)
        reduce = {"sum": sum, "max": max, "min": min}[op]
        return {group: reduce(values) for group, values in groups.items()}

    def labels(self) -> list[str]:
        self.take()  # by
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            names.append(self.take())
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return names


def _drop_name(key) -> frozenset:
    return frozenset((k, v) for k, v in key if k != "__name__")


def _apply(op: str, a: float, b: float) -> float | None:
    if op in ("+", "-", "*", "/"):
        if op == "/":
            return a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a))
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    keep = {">": a > b, "<": a < b, "==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b}[op]
    return a if keep else None


def _binary(op: str, left, right):
    if not isinstance(left, dict) and not isinstance(right, dict):
        return _apply(op, left, right)
    if not isinstance(right, dict):
        out = {k: _apply(op, v, right) for k, v in left.items()}
    elif not isinstance(left, dict):
        out = {k: (_apply(op, left, v) if op in "+-*/" else (v if _apply(op, left, v) is not None else None))
               for k, v in right.items()}
    else:
        out = {k: _apply(op, v, right[k]) for k, v in left.items() if k in right}
    return {k: v for k, v in out.items() if v is not None}


def histogram_quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus's rule: the bucket holding the q-th observation, linear within it."""
    series: dict[frozenset, list[tuple[float, float]]] = {}
    for key, count in buckets.items():
        labels = dict(key)
        le = float(labels.pop("le"))
        series.setdefault(frozenset(labels.items()), []).append((le, count))
    out = {}
    for key, points in series.items():
        points.sort()
        total = points[-1][1]
        if total == 0:
            out[key] = math.nan
            continue
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for le, count in points:
            if count >= rank:
                if math.isinf(le):
                    out[key] = lower_bound
                else:
                    out[key] = lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
                break
            lower_bound, lower_count = le, count
    return out

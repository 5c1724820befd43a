"""A constrained workload shared by the structured-output tests: JSON schemas (nested
objects, arrays, enums, bounded strings and integers), regexes and choices, each with a
checker of its output. With random weights only the constraint makes an output valid."""

from __future__ import annotations

import json
import re
import time

import jsonschema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
POINTS = {
    "type": "object",
    "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                         "ok": {"type": "boolean"}},
        "required": ["x", "ok"]}}},
    "required": ["points"],
}
FLAG = {"type": "object", "properties": {"level": {"enum": [1, 2, 3]},
                                          "note": {"type": "string", "maxLength": 5}},
        "required": ["level", "note"]}
SCHEMAS = [PERSON, POINTS, FLAG]
REGEXES = [r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no), [A-Z][a-z]{1,5}!"]
CHOICES = [["red", "green", "blue"], ["positive", "negative", "neutral"]]
WORDS = ("the river model ray serve engine cluster batch queue step cache block async schedule "
         "mountain light music garden window paper yellow purple quick brown fox").split()


def workload(n: int) -> list[tuple[str, dict]]:
    """``n`` (prompt, constraint) pairs; the constraint is a dict of one of
    json / regex / choice (StructuredOutputsParams' keywords)."""
    items = []
    for i in range(n):
        prompt = " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(3 + i % 5))
        kind = i % 8
        if kind < 4:
            constraint = {"json": SCHEMAS[i % len(SCHEMAS)]}
        elif kind < 6:
            constraint = {"regex": REGEXES[i % len(REGEXES)]}
        else:
            constraint = {"choice": CHOICES[i % len(CHOICES)]}
        items.append((prompt, constraint))
    return items


def check(text: str, constraint: dict) -> None:
    """Raise AssertionError (or a jsonschema error) unless ``text`` satisfies it."""
    if "json" in constraint:
        jsonschema.validate(json.loads(text), constraint["json"])
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), (text, constraint["regex"])
    else:
        assert text in constraint["choice"], (text, constraint["choice"])


def wait_for_free_kv(llm, timeout: float = 30.0) -> None:
    """Requests stopped by EOS leave a step in flight after their final output (async
    scheduling); its blocks are freed when it returns. Wait for that, then check."""
    deadline = time.monotonic() + timeout
    while True:
        m = llm.get_metrics()
        if m["raylm:kv_cache_usage_perc"] == 0.0 and m["raylm:num_requests_running"] == 0:
            return
        assert time.monotonic() < deadline, f"KV blocks still in use after {timeout}s: {m}"
        time.sleep(0.05)

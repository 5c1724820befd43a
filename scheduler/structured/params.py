"""StructuredOutputsParams: what a request's output must match (vLLM's names and fields).

Exactly one constraint per request: a JSON schema (``json``), a regular expression
(``regex``), one of fixed strings (``choice``), an EBNF grammar (``grammar``) or any JSON
object (``json_object=True``). Pure data: whether a schema or regex compiles is checked by
the structured-output backend before the request reaches the engine.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON only: no whitespace between tokens the schema does not require (compact JSON).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of strings, "
                                 f"got {self.choice!r}.")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty.")
        kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {kinds or 'none'}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or a "
                             f"JSON string), got {type(self.json).__name__}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}.")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (a schema canonicalised), for the grammar cache."""
        kind = self.kind
        if kind == "json":
            if isinstance(self.json, dict):
                return _json.dumps(self.json, sort_keys=True, separators=(",", ":"))
            return str(self.json)
        if kind == "choice":
            return _json.dumps(list(self.choice or ()))
        if kind == "json_object":
            return ""
        return str(getattr(self, kind))

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        return (self.kind, self.spec, self.disable_any_whitespace)

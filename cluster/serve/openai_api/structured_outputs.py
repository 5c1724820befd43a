"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` extra, as request fields.

Both become one ``StructuredOutputsParams`` on the request's SamplingParams. The intake
(``validate_prompt``) compiles the spec once, without a tokenizer, so a schema, regex or
grammar that cannot compile is a 400 naming the problem before anything reaches the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from raylm.scheduler.structured.params import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    # "schema" shadows a BaseModel attribute: keep it under an alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, json_object or json_schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` extra body field (the subset this server runs)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


def to_structured_outputs_params(response_format: ResponseFormat | None,
                                 structured_outputs: StructuredOutputsRequest | None
                                 ) -> StructuredOutputsParams | None:
    """The request's constraint (not compiled here: the intake does that); ValueError
    names the field."""
    params = None
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            params = StructuredOutputsParams(json_object=True)
        else:
            fmt = response_format.json_schema
            if fmt is None or fmt.json_schema is None:
                raise ValueError("response_format.json_schema.schema is required when "
                                 "response_format.type is 'json_schema'.")
            params = StructuredOutputsParams(json=fmt.json_schema)
    if structured_outputs is not None:
        if params is not None:
            raise ValueError("response_format and structured_outputs cannot both constrain "
                             "one request.")
        so = structured_outputs
        params = StructuredOutputsParams(
            json=so.json_, regex=so.regex,
            choice=tuple(so.choice) if so.choice is not None else None, grammar=so.grammar,
            json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace)
    return params

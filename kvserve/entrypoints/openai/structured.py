"""A request's output constraint: OpenAI's `response_format` or vLLM's `structured_outputs`
extra, checked here so that a bad one is a 400 naming the field the client sent."""

from __future__ import annotations

from kvserve.entrypoints.openai.errors import OpenAIError
from kvserve.entrypoints.openai.protocol import SamplingRequest
from kvserve.structured_output import grammar
from kvserve.structured_output.params import StructuredOutputsParams


def structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
    response_format = request.response_format
    constrains_format = response_format is not None and response_format.type != "text"
    if constrains_format and request.structured_outputs is not None:
        raise OpenAIError(400, "response_format and structured_outputs cannot both constrain the "
                          "output; send one", param="structured_outputs")
    if constrains_format:
        if response_format.type == "json_object":
            field, values = "response_format", {"json_object": True}
        else:
            json_schema = response_format.json_schema
            if json_schema is None or json_schema.schema_ is None:
                raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema",
                                  param="response_format.json_schema")
            field, values = "response_format.json_schema.schema", {"json": json_schema.schema_}
    elif request.structured_outputs is not None:
        field, values = "structured_outputs", request.structured_outputs
    else:
        return None
    try:
        params = StructuredOutputsParams(**values)
        grammar.check(params)
    except grammar.GrammarError as error:
        where = field if field != "structured_outputs" else f"structured_outputs.{error.kind}"
        raise OpenAIError(400, f"{where} {error.reason}", param=field) from None
    except (TypeError, ValueError) as error:
        raise OpenAIError(400, f"{field}: {error}", param=field) from None
    return params

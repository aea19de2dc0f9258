"""The server's OpenAPI 3.0 description (``GET /v2/openapi.json``): KServe v2 REST as served
here, so a fuzzer (schemathesis) and API tools know the endpoints, bodies and error codes."""

from __future__ import annotations

from gpulens import __version__
from gpulens.serve.protocol import DATATYPES

_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    text = {400: "Bad request (malformed JSON, wrong tensor name, shape or datatype)",
            404: "Unknown model or version", 405: "Method not allowed",
            413: "Body larger than --max-body-mb", 500: "The model failed",
            503: "The model's queue is full (see Retry-After) or the server stops"}  # fmt: skip
    return {str(c): _json(_ERROR, text[c]) for c in codes}


def openapi_document(models: list[str], generative: list[str] | None = None) -> dict:
    """The description; ``models``: the served model names (the path parameter's values);
    ``generative``: the language models also served at ``/v1/completions``."""
    name = {"name": "name", "in": "path", "required": True,
            "schema": {"type": "string", "enum": list(models)}}  # fmt: skip
    tensor_meta = {
        "type": "object",
        "required": ["name", "datatype", "shape"],
        "properties": {
            "name": {"type": "string"},
            "datatype": {"type": "string", "enum": list(DATATYPES)},
            "shape": {"type": "array", "items": {"type": "integer"}},
        },
    }
    data = {"type": "array", "items": {}}
    request_input = {
        "type": "object",
        "required": ["name", "shape", "datatype", "data"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {"type": "string", "enum": list(DATATYPES)},
            "parameters": {"type": "object"},
            "data": data,
        },
    }
    response_output = {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}},
            "datatype": {"type": "string"},
            "parameters": {"type": "object"},
            "data": data,
        },
    }
    infer_request = {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "inputs": {"type": "array", "minItems": 1, "items": request_input},
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
                },
            },
        },
    }
    infer_response = {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "outputs": {"type": "array", "items": response_output},
        },
    }
    model_metadata = {
        "type": "object",
        "required": ["name", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": tensor_meta},
            "outputs": {"type": "array", "items": tensor_meta},
        },
    }

    def get(summary: str, ok: dict, *errors: int, params: list | None = None) -> dict:
        op = {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}
        if params:
            op["parameters"] = params
        return {"get": op}

    paths = _paths(name, tensor_meta, infer_request, infer_response, model_metadata, get)
    if generative:
        paths.update(_completion_paths(generative))
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "gpulens serve (KServe v2 / Open Inference Protocol)",
            "version": __version__,
        },  # fmt: skip
        "paths": paths,
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {"type": "string"}},
                },
                "OpenAIError": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {"type": "object", "required": ["message", "type"]}},
                },
            }
        },
    }


def _completion_paths(generative: list[str]) -> dict:
    """``/v1/completions`` and ``/v1/models`` (OpenAI-compatible)."""
    err = {"$ref": "#/components/schemas/OpenAIError"}
    text = {400: "Bad request (malformed JSON, bad field, prompt + max_tokens over the context)",
            404: "Unknown model", 413: "Body larger than --max-body-mb",
            503: "The model's queue is full (see Retry-After) or the server stops"}  # fmt: skip
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer"}}
    text_prompt = {"type": "string", "minLength": 1}
    # OpenAI's batch form is accepted with one prompt in it: ["text"] or [[ids]]
    one = {"type": "array", "minItems": 1, "maxItems": 1}
    prompt = {"oneOf": [text_prompt, ids, {**one, "items": text_prompt}, {**one, "items": ids}]}
    body = {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string", "enum": list(generative)},
            "prompt": prompt,
            # null is the default, as in OpenAI's API
            "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
            "stream": {"type": "boolean", "nullable": True},
            "stream_options": {"type": "object", "nullable": True,
                               "properties": {"include_usage": {"type": "boolean"}}},
        },
    }  # fmt: skip
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
    ok = {
        "description": "One completion (JSON), or server-sent events ending in data: [DONE]",
        "content": {"application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": event}},
    }  # fmt: skip
    return {
        "/v1/completions": {
            "post": {
                "summary": "OpenAI-compatible text completion (byte-level tokens)",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": body}}},
                "responses": {"200": ok, **{str(c): _json(err, t) for c, t in text.items()}},
            }  # fmt: skip
        },
        "/v1/models": {"get": {"summary": "The language models served",
                               "responses": {"200": _json({"type": "object"}, "Models")}}},
    }  # fmt: skip


def _paths(name, tensor_meta, infer_request, infer_response, model_metadata, get) -> dict:
    flag = {"type": "object", "properties": {"live": {"type": "boolean"},
                                             "ready": {"type": "boolean"}}}  # fmt: skip
    return {
        "/v2/health/live": get("Server liveness", _json(flag, "Live")),
        "/v2/health/ready": get("Server readiness", _json(flag, "Ready"), 400),
        "/v2": get(
            "Server metadata",
            _json(
                {"type": "object", "required": ["name", "version", "extensions"]},
                "Server metadata",
            ),
        ),  # fmt: skip
        "/v2/models/{name}": get(
            "Model metadata", _json(model_metadata, "Model metadata"), 404, params=[name]
        ),  # fmt: skip
        "/v2/models/{name}/ready": get(
            "Model readiness", _json(flag, "Ready"), 400, 404, params=[name]
        ),  # fmt: skip
        "/v2/models/{name}/infer": {
            "post": {
                "summary": "Inference (JSON tensors; binary tensor data extension with the "
                "Inference-Header-Content-Length header)",
                "parameters": [name],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": infer_request}},
                },
                "responses": {
                    "200": _json(infer_response, "Inference response"),
                    **_errors(400, 404, 413, 500, 503),
                },
            }
        },
        "/metrics": get(
            "Prometheus metrics (Triton's names)",
            {
                "description": "Text exposition format 0.0.4",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
        ),  # fmt: skip
    }

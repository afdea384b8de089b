"""An OpenAPI 3.1 description of the gateway's HTTP surface, served at /openapi.json.

It describes what the gateway itself accepts and answers (authentication, the fields it
reads or rejects, its error shape), not every sampling parameter vLLM takes: unknown
body fields pass through to the replica. Fuzzers use it to reach every route.
"""

from __future__ import annotations

from typing import Any

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["integer", "string", "null"]},
        },
    }},
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "properties": {
                "type": {"type": "string"}, "text": {"type": "string"}}}},
            {"type": "null"},
        ]},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "tool_call_id": {"type": "string"},
    },
}

_COMMON = {
    "model": {"type": "string", "description": "Optional where the gateway serves one model "
                                               "(as vLLM serves its own)."},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {
        "include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "user": {"type": "string"},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": 128,
                   "description": "Set by the gateway per tenant; a client's own is rejected "
                                  "or namespaced as the tenant's config says."},
    "return_token_ids": {"type": "boolean"},
}

_CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {**_COMMON,
                   "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                   "max_completion_tokens": {"type": "integer", "minimum": 1},
                   "tools": {"type": "array", "items": {"type": "object"}},
                   "add_generation_prompt": {"type": "boolean"},
                   "continue_final_message": {"type": "boolean"},
                   "chat_template_kwargs": {"type": "object"}},
}

_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {**_COMMON,
                   "prompt": {"oneOf": [
                       {"type": "string"},
                       {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                       {"type": "array", "items": {"type": "string"}, "minItems": 1},
                       {"type": "array", "minItems": 1, "items": {
                           "type": "array", "items": {"type": "integer", "minimum": 0}}},
                   ]},
                   "echo": {"type": "boolean"}},
}

_USAGE = {"type": "object", "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": ["object", "null"], "properties": {
        "cached_tokens": {"type": "integer"}}}}}

_COMPLETION_RESPONSE = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"type": "string"}, "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object"}}, "usage": _USAGE}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "Malformed or invalid body", 401: "Missing or invalid API key",
            404: "Unknown model", 413: "Body larger than proxy.max_body_bytes",
            429: "Overloaded; retry after the Retry-After header's seconds",
            502: "Every replica tried failed before the first byte",
            503: "No replica available", 504: "Replica timed out before the first token"}
    out: dict[str, Any] = {}
    for code in codes:
        entry: dict[str, Any] = {"description": text[code], "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        if code == 429:
            entry["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
        out[str(code)] = entry
    return out


def _generation(summary: str, schema: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}],
        "parameters": [
            {"name": "x-request-id", "in": "header", "schema": {"type": "string"}},
            {"name": "traceparent", "in": "header", "schema": {"type": "string"}},
            {"name": "tracestate", "in": "header", "schema": {"type": "string"}},
            {"name": "x-session-id", "in": "header", "schema": {"type": "string"}},
        ],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {
            "200": {"description": "The replica's answer, unchanged (JSON, or SSE when stream)",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Completion"}},
                        "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 404, 413, 429, 502, 503, 504),
        },
    }}


def _passed(summary: str) -> dict[str, Any]:
    """A POST the gateway forwards with the body as sent (bar cache_salt); it reads only
    `model` (and, where routed cache-aware, the conversation)."""
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "properties": {"model": {"type": "string"}}}}}},
        "responses": {"200": {"description": "The replica's answer, unchanged"},
                      **_errors(400, 401, 404, 413, 429, 502, 503)},
    }}


def openapi_spec() -> dict[str, Any]:
    """The OpenAPI document."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "cacheroute gateway", "version": "0.1.0",
                 "description": "A cache-aware OpenAI-compatible gateway for vLLM replicas."},
        "paths": {
            "/v1/chat/completions": _generation("Chat completion, routed cache-aware", "ChatRequest"),
            "/v1/completions": _generation("Text completion, routed cache-aware", "CompletionRequest"),
            "/v1/models": {"get": {
                "summary": "Models the fleet serves (union)", "security": [{"bearer": []}],
                "responses": {"200": {"description": "Model list", "content": {"application/json": {
                    "schema": {"type": "object", "properties": {
                        "object": {"type": "string"},
                        "data": {"type": "array", "items": {"type": "object", "properties": {
                            "id": {"type": "string"}}}}}}}}},
                    **_errors(401)}}},
            "/v1/responses": _passed("Responses API, routed cache-aware by its messages"),
            "/v1/messages": _passed("Anthropic Messages API, routed cache-aware by its messages"),
            "/tokenize": _passed("vLLM's /tokenize, on the least loaded replica of the model"),
            "/detokenize": _passed("vLLM's /detokenize, on any replica (of the model, if named)"),
            "/v1/embeddings": _passed("Embeddings, on the least loaded replica of the model"),
            "/version": {"get": {"summary": "vLLM's version, from any available replica",
                                 "security": [{"bearer": []}], "responses": {
                                     "200": {"description": "The replica's answer"},
                                     **_errors(401, 502, 503)}}},
            "/health": {"get": {"summary": "Process alive", "responses": {
                "200": {"description": "Alive"}}}},
            "/ready": {"get": {"summary": "Has an available replica; index and replica states",
                               "responses": {"200": {"description": "Ready"},
                                             "503": {"description": "No replica available"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (cacheroute_*)", "responses": {
                "200": {"description": "Exposition text", "content": {
                    "text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {
                "200": {"description": "OpenAPI document"}}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": _ERROR, "ChatRequest": _CHAT_REQUEST,
                        "CompletionRequest": _COMPLETION_REQUEST,
                        "Completion": _COMPLETION_RESPONSE},
        },
    }

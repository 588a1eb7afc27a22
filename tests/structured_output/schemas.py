"""JSON schemas that structured-output tests constrain generation to: nested objects, arrays
with item bounds, enums, required and optional properties, bounded numbers, strings with
lengths and patterns. Every string and array is bounded, so a sample can finish within its
max_tokens."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SHORT = {"type": "string", "maxLength": 8}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[dict] = [
    obj({"name": NAME, "age": AGE}),
    obj({"name": NAME, "age": AGE}, required=["name"]),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"count": {"type": "integer", "minimum": -5, "maximum": 5}}),
    obj({"score": {"type": "integer", "minimum": 10, "maximum": 99}}),
    obj({"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                 "minItems": 2, "maxItems": 4}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"user": obj({"name": NAME, "admin": {"type": "boolean"}})}),
    obj({"point": obj({"x": AGE, "y": AGE})}),
    obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    obj({"people": {"type": "array", "items": obj({"name": NAME, "age": AGE}),
                    "minItems": 1, "maxItems": 2}}),
    obj({"status": {"const": "done"}, "value": AGE}),
    obj({"unit": {"enum": ["kg", "lb"]}, "amount": {"type": "integer", "minimum": 1,
                                                    "maximum": 500}}),
    obj({"title": NAME, "note": SHORT}, required=["title"]),
    obj({"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
         "hour": {"type": "integer", "minimum": 0, "maximum": 23}}),
    obj({"matrix": {"type": "array", "minItems": 1, "maxItems": 2,
                    "items": {"type": "array", "minItems": 1, "maxItems": 2,
                              "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    obj({"flag": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}}),
    obj({"name": NAME, "nick": {"anyOf": [SHORT, {"type": "null"}]}}),
    obj({"choice": {"enum": ["yes", "no", "maybe"]}, "why": SHORT}, required=["choice"]),
    obj({"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                 "minItems": 3, "maxItems": 3}}),
    obj({"meta": obj({"version": {"type": "integer", "minimum": 1, "maximum": 9},
                      "stable": {"type": "boolean"}}), "name": NAME}),
    obj({"letters": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
         "month": {"type": "integer", "minimum": 1, "maximum": 12}}),
    obj({"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"}, "stock": AGE}),
    obj({"empty": obj({}, required=[])}),
    {"type": "array", "items": obj({"k": SHORT}), "minItems": 1, "maxItems": 2},
]

"""What is generated from the event models in `streaming/events.py` (the one definition of the schema).

- The JSON Schema files `streaming/schemas/*.v1.json` (for producers in other languages and for
  reviewers). Regenerate after changing a model with `python -m streaming.event_schemas`;
  `tests/unit/test_streaming_events.py` fails while a file is stale.
- The replay store's Arrow schemas (`streaming/store.py`): one column per model field (schema_version
  left out, nested models flattened into their fields), then the store's own columns.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel

from streaming.events import SCHEMA_FILE_OF_MODEL, SCHEMA_VERSION, WIRE_REQUIRED, FeedbackEvent, QueryLogEvent

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
_ID = "https://dynrubric.dev/schemas/"


def _drop_titles(node: Any) -> Any:
    """pydantic titles every property with its own name: noise in a file people read."""
    if isinstance(node, dict):
        return {k: _drop_titles(v) for k, v in node.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(node, list):
        return [_drop_titles(v) for v in node]
    return node


def json_schema(model: type[QueryLogEvent] | type[FeedbackEvent]) -> dict[str, Any]:
    """The JSON Schema 2020-12 document of an event model, as the wire sees it (`WIRE_REQUIRED` required)."""
    generated = _drop_titles(model.model_json_schema(mode="validation"))
    props = generated["properties"]
    props["schema_version"] = {"const": SCHEMA_VERSION, "description": "version of this schema"}
    doc: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": _ID + SCHEMA_FILE_OF_MODEL[model],
        "title": model.__name__,
        "description": " ".join((model.__doc__ or "").split()),
        "type": "object",
        "additionalProperties": False,
        "required": [n for n in model.model_fields if n in {*generated.get("required", []), *WIRE_REQUIRED[model]}],
        "properties": {"schema_version": props.pop("schema_version"), **props},
    }
    doc.update({k: v for k, v in generated.items() if k in ("allOf", "$defs")})
    return doc


def schema_text(model: type[QueryLogEvent] | type[FeedbackEvent]) -> str:
    return json.dumps(json_schema(model), indent=2, ensure_ascii=False) + "\n"


def write_schemas(directory: Path = SCHEMA_DIR) -> list[Path]:
    written = []
    for model, name in SCHEMA_FILE_OF_MODEL.items():
        path = directory / name
        path.write_text(schema_text(model))
        written.append(path)
    return written


# ---------------------------------------------------------------- Arrow
def _arrow_type(annotation: Any) -> pa.DataType:
    """The Arrow type of a field annotation. Every column stays nullable (Arrow's default), as in the
    shards written before the schema was generated, so old and new shards read as one table."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _arrow_type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        [inner] = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _arrow_type(inner)
    if origin is Literal or annotation is str:
        return pa.string()
    if annotation is bool:
        return pa.bool_()
    if annotation is float:
        return pa.float64()
    if annotation is int:
        return pa.int64()
    if origin is list:
        [item] = typing.get_args(annotation)
        return pa.list_(_arrow_type(item))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return pa.struct([(n, _arrow_type(f.annotation)) for n, f in annotation.model_fields.items()])
    raise TypeError(f"no Arrow type for {annotation!r}")


def arrow_fields(model: type[BaseModel], flatten: tuple[str, ...] = ()) -> list[pa.Field]:
    """One Arrow field per model field, schema_version left out; the fields named in `flatten` (nested
    models) become their own fields' columns."""
    fields = []
    for name, info in model.model_fields.items():
        if name == "schema_version":
            continue
        if name in flatten:
            fields.extend(arrow_fields(typing.cast(type[BaseModel], info.annotation)))  # a nested model
            continue
        fields.append(pa.field(name, _arrow_type(info.annotation)))
    return fields


if __name__ == "__main__":
    for path in write_schemas():
        print(f"wrote {path}", file=sys.stderr)

"""A model's configuration as Triton writes it as JSON (core's ModelConfigToJson): what its HTTP config
endpoint answers and what a Python model reads in `initialize(args["model_config"])`.

Protobuf's JSON mapping with field names kept and every field without presence printed, zeros and
empty lists included (Triton's `always_print_primitive_fields`): clients read `max_batch_size` even
when it is 0, and an absent key is an AttributeError in tritonclient's image_client.py. Protobuf
writes 64-bit integers as strings; Triton turns them back into numbers (`"dims": [16]`), and so does
this, for every 64-bit field; map keys stay strings, as JSON needs.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def config_json(config: Message) -> dict[str, Any]:
    data = MessageToDict(config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _numbers(config.DESCRIPTOR, data)


def _numbers(descriptor: Descriptor, data: dict[str, Any]) -> dict[str, Any]:
    for key, value in data.items():
        field = descriptor.fields_by_name.get(key)
        if field is not None:
            data[key] = _field(field, value)
    return data


def _field(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        return {k: _one(value_field, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_one(field, v) for v in value]
    return _one(field, value)


def _one(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE and isinstance(value, dict):
        return _numbers(field.message_type, value)
    if field.type in _INT64 and isinstance(value, str):
        return int(value)
    return value

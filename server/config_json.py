"""A model config as JSON the way Triton writes it: every top-level field (defaults included) and 64-bit
integers (dims, max_queue_delay_microseconds...) as numbers, where protobuf's own JSON writes strings.

Python models read it in initialize (`json.loads(args["model_config"])`, then `dims[0] != 1`), and
clients read it from the HTTP config endpoint (`model_config["max_batch_size"]` of a model that does
not batch): both expect Triton's form.
"""

from __future__ import annotations

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from protos import model_config_pb2 as mc


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def config_dict(config: mc.ModelConfig) -> dict:
    """The config as Triton hands it to model code: JSON field names as in config.pbtxt, and 64-bit
    integers (dims, max_queue_delay_microseconds...) as numbers, where protobuf's JSON writes strings."""
    return _numbers(config, json_format.MessageToDict(config, preserving_proto_field_name=True,
                                                      always_print_fields_with_no_presence=True))


def _numbers(message, data: dict) -> dict:
    for field in message.DESCRIPTOR.fields:
        if field.name not in data:
            continue
        value = getattr(message, field.name)
        if field.type in _INT64:
            data[field.name] = list(value) if _repeated(field) else value
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry_value = field.message_type.fields_by_name["value"]
            if entry_value.message_type is not None:
                for key, item in value.items():
                    _numbers(item, data[field.name][str(key)])
        elif field.message_type is not None:
            if _repeated(field):
                for item, item_data in zip(value, data[field.name]):
                    _numbers(item, item_data)
            else:
                _numbers(value, data[field.name])
    return data


def _repeated(field) -> bool:
    return field.label == FieldDescriptor.LABEL_REPEATED

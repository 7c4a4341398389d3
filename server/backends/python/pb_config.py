"""`pb_utils.ModelConfig`: what `auto_complete_config` reads and fills (Triton's rules, Ferry's code).

Only max_batch_size, inputs, outputs, dynamic batching and the transaction policy may be set, and an
input or output the config already declares may only be repeated identically, as in Triton.
"""

from __future__ import annotations

import json

_TENSOR_KEYS = {"name", "data_type", "dims", "optional"}


class ModelConfig:
    def __init__(self, model_config: str | dict):
        self._config = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        self._config.setdefault("input", [])
        self._config.setdefault("output", [])
        self._config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict:
        return self._config

    def _name(self) -> str:
        return self._config.get("name", "")

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._config.get("max_batch_size", 0))
        if current > max_batch_size:
            raise ValueError(f"configuration specified max_batch_size {current}, but in auto-complete-config function "
                             f"for model '{self._name()}' specified max_batch_size {max_batch_size}")
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._config:
                raise ValueError(f"Configuration specified scheduling_choice as '{other}', but auto-complete-config "
                                 f"function for model '{self._name()}' tries to set scheduling_choice as "
                                 "'dynamic_batching'")
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict) -> None:  # Triton's parameter name
        self._add("input", input)

    def add_output(self, output: dict) -> None:
        self._add("output", output)

    def _add(self, kind: str, tensor: dict) -> None:
        extra = set(tensor) - _TENSOR_KEYS - ({"is_shape_tensor"} if kind == "input" else set())
        if extra or not {"name", "data_type", "dims"} <= set(tensor):
            raise ValueError(f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for model "
                             f"'{self._name()}' must have 'name', 'data_type' and 'dims' (and may have 'optional'); "
                             f"it has {sorted(tensor)}")
        for existing in self._config[kind]:
            if existing["name"] == tensor["name"]:
                for key in ("data_type", "dims"):
                    if key in existing and _norm(existing[key]) != _norm(tensor[key]):
                        raise ValueError(f"{kind} '{tensor['name']}' in auto-complete-config function for model "
                                         f"'{self._name()}' has {key} {tensor[key]}, but the configuration "
                                         f"specifies {existing[key]}")
                return
        self._config[kind].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        unknown = set(transaction_policy_dict) - {"decoupled"}
        if unknown:
            raise ValueError(f"model transaction policy in auto-complete-config function for model '{self._name()}' "
                             f"may only set 'decoupled'; it has {sorted(unknown)}")
        current = self._config.get("model_transaction_policy", {})
        wanted = bool(transaction_policy_dict.get("decoupled", False))
        if "decoupled" in current and bool(current["decoupled"]) != wanted:
            raise ValueError(f"trying to change decoupled property in auto-complete-config for model "
                             f"'{self._name()}', which is already set to {current['decoupled']}")
        self._config["model_transaction_policy"] = {"decoupled": wanted}


def _norm(value):
    return [int(v) for v in value] if isinstance(value, list) else value

"""Loading and unloading models on request: one implementation that both doors translate to.

Model control runs code (a model file is code, a python model plainly so) and changes what every
client is served, so it is off unless the operator turns it on, as in Triton: in the default mode
(`none`) and in `poll` mode the load and unload calls are refused with Triton's words and the flag
that enables them; in `explicit` mode they work. A load that carries the model's files with it
(`file:` parameters) uploads code from the caller, a second step the operator takes apart
(`--allow-model-upload`); it is refused before anything is written. Who may call these at all (the
admin token, restricted categories) is server/doors/access.py's question, asked before the call gets here.
"""

from __future__ import annotations

from typing import Any

from server.errors import DisabledError, ModelUnavailableError
from server.names import shown
from server.repository import inline_load
from server.repository.registry import Registry

# Triton's text (tritonclient users match on it), then what to do instead.
CONTROL_REFUSED = ("explicit model load / unload is not allowed if polling is enabled: this server runs with "
                   "--model-control-mode {mode}; start it with --model-control-mode explicit to load and unload")
UPLOAD_REFUSED = ("failed to load {name}: this load carries model files ({files}), which this server does not accept: "
                  "model files run as code on the server; start it with --allow-model-upload (and "
                  "--model-control-mode explicit) to allow it, or put the files in the model repository")


class ModelControl:
    def __init__(self, registry: Registry, mode: str = "none", allow_upload: bool = False):
        self.registry, self.mode, self.allow_upload = registry, mode, allow_upload

    @property
    def enabled(self) -> bool:
        return self.mode == "explicit"

    async def load(self, name: str, parameters: dict[str, Any]) -> None:
        """`parameters`: the load's, decoded (`config` a JSON string, `file:<path>` bytes)."""
        self._check_enabled()
        files = sorted(key for key in parameters if key.startswith("file:"))
        if files and not self.allow_upload:
            raise DisabledError(UPLOAD_REFUSED.format(name=shown(name), files=", ".join(files[:4])
                                                      + (", ..." if len(files) > 4 else "")))
        await self.registry.load(name, inline_load.parse(name, parameters))

    async def unload(self, name: str) -> None:
        self._check_enabled()
        await self.registry.unload(name)

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise ModelUnavailableError(CONTROL_REFUSED.format(mode=self.mode))

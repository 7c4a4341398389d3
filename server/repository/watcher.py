"""Hot reload: poll the repository and (re)load what changed, unload what disappeared.

A model folder's fingerprint is the path, size and modification time of every file in it, so a new
version folder, an edited config or a replaced model file all count as a change. Reloads go through
Registry.load: the new versions must be ready before they replace the old ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from server.errors import FerryError
from server.repository import loader
from server.repository.registry import Registry

log = logging.getLogger(__name__)


def fingerprints(root: Path) -> dict[str, tuple]:
    prints = {}
    for model_dir in loader.scan(root):
        files = []
        for folder, _, names in os.walk(model_dir):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue  # removed while we looked: the next poll sees the settled state
                files.append((os.path.relpath(path, model_dir), st.st_size, st.st_mtime_ns))
        prints[model_dir.name] = tuple(sorted(files))
    return prints


class RepositoryWatcher:
    def __init__(self, registry: Registry, interval_s: float):
        self.registry = registry
        self.interval_s = interval_s
        self._seen: dict[str, tuple] = {}

    async def start(self) -> None:
        self._seen = await asyncio.to_thread(fingerprints, self.registry.root)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="repository-watcher")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll()
            except Exception:  # a bad poll must not end hot reload
                log.exception("polling the model repository failed")

    async def poll(self) -> None:
        current = await asyncio.to_thread(fingerprints, self.registry.root)
        for name, print_ in current.items():
            if self._seen.get(name) != print_:
                log.info("model '%s' changed on disk: loading it", name)
                try:
                    await self.registry.load(name)
                except FerryError as exc:
                    log.error("%s", exc.message)
        for name in self._seen.keys() - current.keys():
            log.info("model '%s' left the repository: unloading it", name)
            try:
                await self.registry.unload(name)
            except FerryError as exc:
                log.error("%s", exc.message)
        self._seen = current

    async def stop(self) -> None:
        if getattr(self, "_task", None) is not None:
            self._task.cancel()

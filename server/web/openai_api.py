"""Placeholder."""


class OpenAIRoutes:
    def __init__(self, registry, body_limit: int):
        self.registry, self.body_limit = registry, body_limit

    def routes(self) -> list:
        return []

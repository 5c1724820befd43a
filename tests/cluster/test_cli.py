"""The `raylm` command: argument mapping (in process), and every subcommand as a real
subprocess: demo-model, generate, batch (also under `ray job submit`), serve (+ Ctrl-C)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from serve_helpers import wait_until_healthy
from test_openai_fakes import free_port

from raylm.cluster.cli import build_llm_config, build_parser, main
from raylm.cluster.engine.engine_args import cli_engine_kwargs

RAYLM = [sys.executable, "-m", "raylm.cluster.cli"]


def run_cli(*args: str, env: dict | None = None, cwd: str | None = None, timeout: float = 240):
    return subprocess.run([*RAYLM, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def test_engine_flags_map_to_engine_kwargs():
    args = build_parser().parse_args([
        "serve", "/m", "-tp", "2", "--pipeline-parallel-size", "3", "--no-async-scheduling",
        "--max-num-seqs", "8", "--max-model-len", "512", "--num-kv-blocks", "64",
        "--dtype", "float32", "--max-queued-requests", "5", "--port", "9001"])
    assert cli_engine_kwargs(args) == {
        "tensor_parallel_size": 2, "pipeline_parallel_size": 3, "async_scheduling": False,
        "max_num_seqs": 8, "max_model_len": 512, "num_kv_blocks": 64, "dtype": "float32",
        "max_queued_requests": 5}
    assert args.port == 9001 and args.host == "127.0.0.1"
    assert cli_engine_kwargs(build_parser().parse_args(["serve"])) == {}


def test_serve_flags_build_the_llm_config(llama_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = build_parser().parse_args([
        "serve", llama_path, "--served-model-name", "mine", "--min-replicas", "1",
        "--max-replicas", "3", "--target-ongoing-requests", "4", "--api-key", "k",
        "--max-num-seqs", "16"])
    cfg = build_llm_config(args)
    assert cfg.model_id == "mine" and cfg.model_loading_config.model_source == llama_path
    assert cfg.engine_kwargs.max_num_seqs == 16 and cfg.api_key == "k"
    auto = cfg.deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 3, 4)
    # The engine runs in actors of its own: a bundle for the replica, one for the worker.
    assert cfg.engine_kwargs.distributed_executor_backend == "ray"
    assert cfg.get_placement_group().bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    in_replica = build_llm_config(build_parser().parse_args(
        ["serve", llama_path, "--distributed-executor-backend", "uni"]))
    assert in_replica.engine_kwargs.distributed_executor_backend == "uni"


def test_serve_lends_the_node_to_prompt_waves_only_when_it_owns_the_node(llama_path,
                                                                         monkeypatch):
    """One single-rank replica on the local Ray instance `raylm serve` starts: steps of a
    wave of prompts take every usable CPU (cpu_burst_threads); with autoscaling to several
    replicas, several ranks, a cluster it joins, or the flag given, the rank keeps its own."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("raylm.cluster.cli.usable_cpus", lambda: 4)

    def burst(*flags: str, address: str | None = None) -> int | None:
        if address is None:
            monkeypatch.delenv("RAY_ADDRESS", raising=False)
        else:
            monkeypatch.setenv("RAY_ADDRESS", address)
        args = build_parser().parse_args(["serve", llama_path, *flags])
        return build_llm_config(args).engine_kwargs.cpu_burst_threads

    assert burst() == 4
    assert burst("--num-replicas", "1") == 4
    assert burst("--cpu-burst-threads", "3") == 3
    assert burst("--max-replicas", "2") is None
    assert burst("--num-replicas", "2") is None
    assert burst("-tp", "2") is None
    assert burst(address="ray://head:10001") is None
    monkeypatch.setattr("raylm.cluster.cli.usable_cpus", lambda: 1)
    assert burst() is None


def test_bad_values_exit_2_before_ray_starts(llama_path, capsys):
    assert main(["serve", llama_path, "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="config.json"):
        main(["serve", "/no/such/model"])


def test_serve_http_flags_build_the_app_http_config(llama_path, monkeypatch):
    from raylm.cluster.cli import http_server_config
    from raylm.cluster.serve.deployment.deployment_config import HTTPServerConfig

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = build_parser().parse_args([
        "serve", llama_path, "--allowed-origins", '["https://a.example", "https://b.example"]',
        "--allowed-methods", "GET,POST", "--allowed-headers", "Authorization",
        "--allow-credentials", "--max-request-body-bytes", "4096", "--max-json-depth", "8",
        "--public-metrics", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--max-n", "4", "--max-logprobs", "3", "--grammar-compile-timeout-s", "2"])
    http = HTTPServerConfig.model_validate(http_server_config(args))
    assert http.allowed_origins == ["https://a.example", "https://b.example"]
    assert (http.allowed_methods, http.allowed_headers) == (["GET", "POST"], ["Authorization"])
    assert http.allow_credentials and http.public_metrics
    assert (http.max_request_body_bytes, http.max_json_depth) == (4096, 8)
    ek = build_llm_config(args).engine_kwargs
    assert (ek.tool_call_parser, ek.reasoning_parser) == ("hermes", "qwen3")
    assert (ek.max_n, ek.max_logprobs, ek.grammar_compile_timeout_s) == (4, 3, 2.0)
    # Unset: CORS off, the defaults of HTTPServerConfig.
    assert http_server_config(build_parser().parse_args(["serve"])) == {}
    assert HTTPServerConfig().allowed_origins == []


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--allowed-origins", "*", "--allow-credentials"], "allow_credentials needs explicit"),
])
def test_bad_serve_http_flags_exit_2_before_ray_starts(llama_path, capsys, flags, message):
    assert main(["serve", llama_path, *flags]) == 2
    assert message in capsys.readouterr().err


def test_unknown_tool_call_parser_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "qwen3_coder"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """A tiny demo model made by the CLI itself, for RAYLM_DEMO_MODEL_DIR."""
    path = str(tmp_path_factory.mktemp("demo") / "demo-model")
    r = run_cli("demo-model", path, "--size", "tiny")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == path
    assert json.load(open(os.path.join(path, "config.json")))["hidden_size"] == 64
    return path


@pytest.fixture(scope="module")
def greedy_hello(llama_path) -> str:
    """What the offline LLM answers to "hello world" (greedy, 6 tokens)."""
    from raylm.cluster.engine.llm import LLM
    from raylm.scheduler.sampling_params import SamplingParams

    with LLM(llama_path) as llm:
        return llm.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0,
                                                            ignore_eos=True))[0].outputs[0].text


def test_generate_matches_the_offline_llm(llama_path, demo_dir, greedy_hello):
    r = run_cli("generate", "hello world", "--model", llama_path, "--max-tokens", "6",
                "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == greedy_hello
    r = run_cli("generate", "hi", "--model", "demo-random", "--max-tokens", "3",
                env={"RAYLM_DEMO_MODEL_DIR": demo_dir})
    assert r.returncode == 0, r.stderr


def _batch_rows(model: str) -> str:
    rows = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": "hello world", "max_tokens": 6, "temperature": 0,
                  "ignore_eos": True}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 4, "ignore_eos": True, "n": 2}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
         "body": {"model": model, "prompt": "x", "top_p": 7}},
    ]
    return "\n".join(json.dumps(r) for r in rows) + "\n"


def _check_batch_output(path: str) -> dict:
    out = {o["custom_id"]: o for o in map(json.loads, open(path).read().splitlines())}
    assert set(out) == {"c1", "chat", "bad"}
    assert out["c1"]["response"]["status_code"] == 200 and out["c1"]["error"] is None
    assert out["c1"]["response"]["body"]["usage"]["completion_tokens"] == 6
    chat = out["chat"]["response"]["body"]
    assert len(chat["choices"]) == 2 and chat["usage"]["completion_tokens"] == 8
    assert out["bad"]["response"]["status_code"] == 400
    assert "top_p" in out["bad"]["error"]["message"]
    return out


@pytest.mark.ray
def test_batch_subprocess(llama_path, tmp_path, greedy_hello):
    (tmp_path / "in.jsonl").write_text(_batch_rows("tiny"))
    r = run_cli("batch", "--input", "in.jsonl", "--output", "out.jsonl", "--model", llama_path,
                "--served-model-name", "tiny", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "3/3 rows" in r.stderr  # the progress line
    assert r.stderr.rstrip().endswith(f"-> {tmp_path / 'out.jsonl'}")  # the path written
    out = _check_batch_output(str(tmp_path / "out.jsonl"))
    assert out["c1"]["response"]["body"]["choices"][0]["text"] == greedy_hello


@pytest.mark.ray
@pytest.mark.slow
def test_batch_as_a_ray_job(llama_path, tmp_path):
    work = tmp_path / "job"
    work.mkdir()
    (work / "in.jsonl").write_text(_batch_rows(llama_path))
    out = tmp_path / "out.jsonl"
    temp_dir = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths
    # Every port free, distinct and explicit: the fixed defaults (e.g. the job agent's 52365)
    # may be held by another Ray instance on this machine, and then no job can be submitted.
    flags = ("port", "dashboard-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
             "ray-client-server-port", "node-manager-port", "object-manager-port")
    ports: dict[str, int] = {}
    while len(ports) < len(flags):
        p = free_port()
        if p not in ports.values():
            ports[flags[len(ports)]] = p
    dash = ports["dashboard-port"]
    # This interpreter runs the head (so its workers import the raylm under test), and its
    # bin folder comes first on PATH (so the job's `raylm` is that raylm too).
    env = {**os.environ, "RAY_AUTH_MODE": "disabled",  # loopback only
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    # --block: this process owns the head; terminating it stops exactly this cluster.
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--num-cpus=4", "--dashboard-host=127.0.0.1",
         f"--temp-dir={temp_dir}", "--disable-usage-stats",
         *(f"--{flag}={p}" for flag, p in ports.items())],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{dash}/api/version").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and head.poll() is None, "ray head did not start"
            time.sleep(0.5)
        while True:
            job = subprocess.run(
                ["ray", "job", "submit", "--address", f"http://127.0.0.1:{dash}",
                 "--working-dir", str(work), "--", "raylm", "batch", "--input", "in.jsonl",
                 "--output", str(out), "--model", llama_path, "--no-progress"],
                env=env, capture_output=True, text=True, timeout=300)
            # The dashboard answers before its job agent is up; Ray says to retry.
            if "No available agent" not in job.stderr or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert job.returncode == 0, job.stdout + job.stderr
        assert "succeeded" in job.stdout + job.stderr
        _check_batch_output(str(out))
        # A relative output would land in Ray's temporary copy of the working dir: refused.
        job = subprocess.run(
            ["ray", "job", "submit", "--address", f"http://127.0.0.1:{dash}",
             "--working-dir", str(work), "--", "raylm", "batch", "--input", "in.jsonl",
             "--output", "out.jsonl", "--model", llama_path],
            env=env, capture_output=True, text=True, timeout=300)
        assert job.returncode != 0 and "working directory" in job.stdout + job.stderr
    finally:
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=60)


@pytest.mark.ray
def test_serve_demo_random_serves_the_demo_model(demo_dir):
    port = free_port()
    proc = subprocess.Popen([*RAYLM, "serve", "demo-random", "--port", str(port)],
                            env={**os.environ, "RAYLM_DEMO_MODEL_DIR": demo_dir},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base, timeout_s=180)
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "model": "raylm-demo", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "raylm-demo"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert "shutting down" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_speculative_config_flag_reaches_the_serve_config(llama_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    args = build_parser().parse_args(["serve", llama_path, "--speculative-config",
                                      json.dumps(spec)])
    assert cli_engine_kwargs(args) == {"speculative_config": spec}
    config = build_llm_config(args)
    assert config.engine_kwargs.to_llm_kwargs()["speculative_config"] == spec
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "[1, 2]"])


def test_proxy_applies_only_to_a_local_instance(llama_path, monkeypatch, capsys):
    from raylm.cluster.serve.deployment.local import local_serve_env

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # refused before any connection
    assert main(["serve", llama_path, "--proxy", "haproxy"]) == 2
    assert "--proxy haproxy applies to the Ray instance" in capsys.readouterr().err
    with pytest.raises(ValueError, match="proxy 'nginx' is unknown"):
        local_serve_env("nginx")
    assert local_serve_env("ray") == {}
    env = local_serve_env("haproxy")
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] != env["RAY_SERVE_HAPROXY_METRICS_PORT"]


def test_pd_flags_build_both_sides_of_the_pd_app(llama_path, monkeypatch):
    """--prefill-replicas / --decode-replicas serve the PD app: each side is the model's
    config with its replica count and, if given, its own TP size; the app's config loads."""
    from raylm.cluster.cli import pd_app_args
    from raylm.cluster.serve.pd.pd_app import PDServingArgs

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = build_parser().parse_args([
        "serve", llama_path, "--prefill-replicas", "2", "--decode-replicas", "1",
        "--decode-tensor-parallel-size", "2", "--max-num-seqs", "8"])
    pd = pd_app_args(args, build_llm_config(args))
    assert pd["prefill_config"]["deployment_config"]["num_replicas"] == 2
    assert pd["decode_config"]["deployment_config"]["num_replicas"] == 1
    assert pd["decode_config"]["engine_kwargs"]["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in pd["prefill_config"]["engine_kwargs"]
    assert all("cpu_burst_threads" not in pd[k]["engine_kwargs"]
               for k in ("prefill_config", "decode_config"))
    parsed = PDServingArgs.model_validate(pd)
    assert parsed.side("decode").engine_kwargs.max_num_seqs == 8
    lora = build_parser().parse_args([
        "serve", llama_path, "--prefill-replicas", "1", "--decode-replicas", "1",
        "--enable-lora"])
    with pytest.raises(ValueError, match="enable_lora: the prefill/decode app serves the base"):
        PDServingArgs.model_validate(pd_app_args(lora, build_llm_config(lora)))

"""`raylm serve` end to end as a user runs it (a subprocess with its own local Ray), for each
HTTP entry: Ray Serve's HAProxy ingress (the default) and Serve's Python proxy, both in front
of the model's replica answering HTTP itself (`ingress_in_replica`), and HAProxy in front of
an ingress deployment (`--separate-ingress`). On each entry, served tokens must equal
offline ones, errors must be OpenAI's envelopes, and a disconnect must abort the request
and free its KV blocks; on the default entry, 64 concurrent streams must get exact token
counts. The server has LoRA on (`--enable-lora --lora-modules
--allowed-lora-root`): the openai SDK reaches each adapter by name, loads and unloads one at
run time, gets 404 for an unknown adapter and 400 for a path outside the root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from serve_helpers import concurrent_streams, wait_until_healthy
from test_openai_fakes import free_port
from test_openai_serve import wait_for

from raylm import LLM, SamplingParams

pytestmark = pytest.mark.ray

MODEL = "tiny"
PROMPTS = ["the quick brown fox", "hello world, this is", "1 2 3 4"]


def _metric(base: str, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.split()[-1])
    return 0.0


def _descendants(root: int) -> list[str]:
    """Command names of every process under ``root``."""
    parents, names = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            pid = int(entry)
            names[pid] = stat[stat.index("(") + 1:stat.rindex(")")]
            parents[pid] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = [], {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier}
        found += [names[p] for p in frontier]
    return found


# entry -> (--proxy, more flags); the first is the default entry.
ENTRIES = {"haproxy": ("haproxy", []), "ray": ("ray", []),
           "haproxy-separate-ingress": ("haproxy", ["--separate-ingress"])}
# Load and LoRA go through the app, not the entry: the default entry alone runs them; every
# entry still runs the entry, stream, error and disconnect checks.
DEFAULT_ENTRY_ONLY = pytest.mark.parametrize("server", ["haproxy"], indirect=True)


@pytest.fixture(scope="module", params=list(ENTRIES))
def server(request, llama_path, lora_adapters):
    proxy, extra = ENTRIES[request.param]
    lora = ["--enable-lora", "--max-loras", "2", "--lora-modules", f"first={lora_adapters[0]}",
            "--allowed-lora-root", os.path.dirname(lora_adapters[0])]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "raylm.cluster.cli", "serve", llama_path, "--port", str(port),
         "--served-model-name", MODEL, "--proxy", proxy, "--max-num-seqs", "64",
         "--max-ongoing-requests", "128", *lora, *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base)
        yield proxy, base, proc
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def offline_tokens(llama_path):
    llm = LLM(llama_path, max_num_seqs=8)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    logprobs=0), use_tqdm=False)
        # The served logprobs name each token by its text: compare those.
        return [[lp[t].decoded_token for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                       strict=True)] for o in outs]
    finally:
        llm.shutdown()


def test_the_entry_is_the_one_asked_for(server):
    proxy, _, proc = server
    processes = _descendants(proc.pid)
    assert ("haproxy" in processes) == (proxy == "haproxy")
    # The engine runs in actors of its own, not in the replica (SERVE_EXECUTOR_BACKEND);
    # /proc truncates a process name to 15 characters.
    assert {"ray::EngineCore", "ray::WorkerActo"} <= set(processes), processes


def test_streamed_and_whole_tokens_equal_offline(server, offline_tokens):
    _, base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    for prompt, expected in zip(PROMPTS, offline_tokens, strict=True):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                          temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True})
        streamed, tokens = "", []
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                               temperature=0, logprobs=0, stream=True,
                                               extra_body={"ignore_eos": True}):
            if chunk.choices:
                streamed += chunk.choices[0].text
                tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
        assert whole.usage.completion_tokens == len(expected) == 12
        assert streamed == whole.choices[0].text
        assert tokens == whole.choices[0].logprobs.tokens == expected


def test_errors_are_openai_envelopes(server):
    _, base, _ = server
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{base}/v1/completions", json={"model": "gone", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_disconnect_aborts_and_frees_kv(server):
    _, base, _ = server
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert sum(1 for _ in zip(range(4), (ln for ln in lines if ln.startswith("data: ")))) == 4
        assert _metric(base, "raylm:num_requests_running") == 1
    wait_for(lambda: _metric(base, "raylm:num_requests_running") == 0)
    assert _metric(base, "raylm:kv_cache_usage_perc") == 0
    assert _metric(base, "raylm:request_success_total", finished_reason="abort") >= 1


@DEFAULT_ENTRY_ONLY
def test_64_concurrent_streams_get_exact_token_counts(server):
    _, base, _ = server
    assert concurrent_streams(base, MODEL) == [("length", 16)] * 64
    wait_for(lambda: _metric(base, "raylm:num_requests_running") == 0)


@DEFAULT_ENTRY_ONLY
def test_lora_adapters_through_the_openai_sdk(server, lora_adapters, peft_oracle, llama_path):
    from transformers import AutoTokenizer

    _, base, _ = server
    tok = AutoTokenizer.from_pretrained(llama_path)
    prompt = [17, 230, 41, 99, 5]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)

    def text(model: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=6,
                                         temperature=0).choices[0].text

    def peft(adapter) -> str:
        return tok.decode(peft_oracle.greedy(adapter, prompt, 6))

    assert text("first") == peft(lora_adapters[0]) != text(MODEL)
    assert {m.id: m.parent for m in client.models.list().data}["first"] == MODEL
    post = httpx.Client(base_url=base, timeout=60).post
    r = post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": lora_adapters[1]})
    assert r.status_code == 200, r.text
    assert text("late") == peft(lora_adapters[1])
    assert post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        text("late")
    with pytest.raises(openai.NotFoundError):
        text("no-such-adapter")
    r = post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": llama_path})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"

"""Shared fixtures: small random-weight checkpoints written on the fly (nothing downloaded)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

# The equality tests are defined in float32: dtype="auto" would run these float32
# checkpoints in bfloat16 on a CPU with native bf16. Set before any engine (or Ray worker,
# which inherits the environment) starts; the bf16 tests ask for bfloat16 explicitly.
os.environ.setdefault("RAYLM_CPU_AUTO_BFLOAT16", "0")
# A test engine writes a few blocks of its 1 GiB default KV pool: faulting all of it in at
# start-up cost each rank a second or two and the machine a GiB of memory per rank
# (test_host_memory.py covers the prefaulted pool).
os.environ.setdefault("RAYLM_CPU_KV_PREFAULT", "0")

from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint


def _write(tmp_path_factory, name: str, spec: CheckpointSpec) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp(name)), spec)


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> str:
    """Llama with GQA (4 query heads, 2 KV heads), untied embeddings."""
    return _write(tmp_path_factory, "llama", CheckpointSpec())


@pytest.fixture(scope="session")
def llama_mha_tied_path(tmp_path_factory) -> str:
    """Llama with MHA and tied embeddings, and linear rope scaling."""
    spec = CheckpointSpec(num_key_value_heads=4, tie_word_embeddings=True,
                          rope_scaling={"rope_type": "linear", "factor": 2.0}, seed=1)
    return _write(tmp_path_factory, "llama_mha_tied", spec)


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory) -> str:
    """Qwen2: biases on q/k/v projections."""
    return _write(tmp_path_factory, "qwen2", CheckpointSpec(architecture="Qwen2ForCausalLM", seed=2))


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory) -> str:
    """Qwen3: per-head RMSNorm on q and k, explicit head_dim, tied embeddings."""
    spec = CheckpointSpec(architecture="Qwen3ForCausalLM", head_dim=32, tie_word_embeddings=True, seed=3)
    return _write(tmp_path_factory, "qwen3", spec)


@pytest.fixture(scope="session")
def loopy_llama_path(tmp_path_factory) -> str:
    """A random Llama whose attention output is scaled down 250x: its next token depends
    mostly on the current one, so greedy text falls into loops that prompt lookup predicts
    (speculative decoding tests: a plain random model almost never repeats, so nearly
    every draft would be rejected). Attention still contributes, so misplaced KV still
    changes the tokens."""
    from raylm.runner.loading.checkpoint import scale_attention_output

    path = _write(tmp_path_factory, "loopy_llama", CheckpointSpec(seed=6))
    scale_attention_output(path, 0.004)
    return path


@pytest.fixture(scope="session")
def loopy_draft_path(tmp_path_factory) -> str:
    """A draft model for ``loopy_llama_path``: the same weights with attention scaled down
    5x less, so it proposes what the target would often but not always (speculative
    decoding tests: partial acceptance, rollbacks)."""
    from raylm.runner.loading.checkpoint import scale_attention_output

    path = _write(tmp_path_factory, "loopy_draft", CheckpointSpec(seed=6))
    scale_attention_output(path, 0.02)
    return path


@pytest.fixture(scope="session")
def loopy_bamba_path(tmp_path_factory) -> str:
    """A random Bamba (Mamba2 at layers 0, 2, 3, attention at 1) whose mixers' outputs are
    scaled down 100x: greedy text falls into loops that prompt lookup predicts, partly
    (speculative decoding on a hybrid: partial acceptance), and the mixers still change
    the tokens (a verification step's next step continuing from the wrong state fails
    the equality tests)."""
    from raylm.runner.loading.checkpoint import scale_attention_output

    path = _write(tmp_path_factory, "loopy_bamba",
                  CheckpointSpec(architecture="BambaForCausalLM", num_hidden_layers=4,
                                 attn_layer_indices=(1,), seed=41))
    scale_attention_output(path, 0.01, ("o_proj.weight", "out_proj.weight"))
    return path


@pytest.fixture(scope="session")
def bamba_mlp_draft_path(loopy_bamba_path, tmp_path_factory) -> str:
    """A Llama draft for ``loopy_bamba_path`` made of its embedding, norms, MLPs and LM
    head with silent attention: it proposes what the target's loops mostly are (a draft
    model for a hybrid target, with partial acceptance)."""
    from safetensors.torch import load_file, save_file

    path = _write(tmp_path_factory, "bamba_mlp_draft", CheckpointSpec(num_hidden_layers=4,
                                                                         seed=42))
    target = load_file(os.path.join(loopy_bamba_path, "model.safetensors"))
    draft_file = os.path.join(path, "model.safetensors")
    draft = load_file(draft_file)
    renames = ((".feed_forward.", ".mlp."),
               (".pre_ff_layernorm.", ".post_attention_layernorm."),
               ("model.final_layernorm.", "model.norm."))
    for name, tensor in target.items():
        for old, new in renames:
            name = name.replace(old, new)
        if name in draft:
            draft[name] = tensor
    for name in draft:
        if name.endswith("o_proj.weight"):
            draft[name] = draft[name] * 0.0
    save_file(draft, draft_file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session", params=["llama", "llama_mha_tied", "qwen2", "qwen3"])
def any_model_path(request) -> str:
    return request.getfixturevalue(f"{request.param}_path")


class HFOracle:
    """Hugging Face ``generate`` (greedy) and logits: the correctness reference."""

    def __init__(self, path: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        kwargs = {}
        if path.endswith(".gguf"):  # transformers dequantizes GGUF files itself
            path, kwargs["gguf_file"] = os.path.split(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          **kwargs).eval()
        self.eos = self.model.generation_config.eos_token_id

    def greedy(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
        torch = self.torch
        self.model.generation_config.eos_token_id = None if ignore_eos else self.eos
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=0)
        self.model.generation_config.eos_token_id = self.eos
        return out[0, len(prompt_ids):].tolist()

    def last_hidden_states(self, token_ids: list[int]) -> object:
        """The decoder's final-norm hidden states at every position ([T, hidden])."""
        with self.torch.inference_mode():
            return self.model.model(self.torch.tensor([token_ids])).last_hidden_state[0]

    def logprobs(self, token_ids: list[int]) -> object:
        """log_softmax of the logits at every position of ``token_ids`` ([T, vocab])."""
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="session")
def hf_oracle():
    """hf_oracle(path) -> HFOracle, cached per checkpoint for the session."""
    oracles: dict[str, HFOracle] = {}

    def get(path: str) -> HFOracle:
        if path not in oracles:
            oracles[path] = HFOracle(path)
        return oracles[path]

    return get


# ---- LoRA: random PEFT adapters for the tiny Llama, and transformers + PEFT as oracle ----
# (rank, lora_alpha, use_rslora, target modules): four ranks, rsLoRA, attention only, MLP only.
LORA_SPECS = [
    (8, 16, False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj")),
    (4, 8, True, ("q_proj", "v_proj")),
    (16, 8, False, ("o_proj", "gate_proj", "up_proj", "down_proj")),
    (2, 4, False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj")),
]


@pytest.fixture(scope="session")
def lora_adapters(llama_path, tmp_path_factory) -> list[str]:
    """Four PEFT adapter folders for ``llama_path`` (LORA_SPECS)."""
    from raylm.runner.lora.random_adapter import write_random_adapter

    root = tmp_path_factory.mktemp("lora")
    return [write_random_adapter(str(root / f"adapter{i}"), llama_path, r, alpha,
                                 targets, use_rslora=rslora, seed=10 + i)
            for i, (r, alpha, rslora, targets) in enumerate(LORA_SPECS)]


class PeftOracle:
    """transformers + PEFT greedy generate, the adapter applied unmerged (None: the base
    model alone); results cached per (adapter, prompt, length)."""

    def __init__(self, base_path: str) -> None:
        self.base_path = base_path
        self._models: dict[str | None, object] = {}
        self._cache: dict[tuple, list[int]] = {}

    def _model(self, adapter: str | None):
        if adapter not in self._models:
            import torch
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=torch.float32)
            model.generation_config.eos_token_id = None  # ignore_eos
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapter)  # unmerged
            self._models[adapter] = model.eval()
        return self._models[adapter]

    def greedy(self, adapter: str | None, prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (adapter, tuple(prompt_ids), max_tokens)
        if key not in self._cache:
            import torch

            with torch.inference_mode():
                out = self._model(adapter).generate(
                    torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                    pad_token_id=0)
            self._cache[key] = out[0, len(prompt_ids):].tolist()
        return self._cache[key]


@pytest.fixture(scope="session")
def peft_oracle(llama_path) -> PeftOracle:
    return PeftOracle(llama_path)


@pytest.fixture
def moto_s3(monkeypatch):
    """A moto S3 server on loopback; the AWS variables the driver's pyarrow reads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "moto did not start"
                time.sleep(0.1)
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        import boto3

        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="raylm-test")
        yield s3
    finally:
        proc.kill()
        proc.wait()


# ---- Ray: one instance at a time for the run, each topology started once ----
# (tests/ray_instances.py). A module asks for a topology with one of the fixtures below;
# tests/suite_order.py runs the modules of each topology together.
LOCAL_CPUS = 24  # logical: the most any module's placement groups ask for at once


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


class WorkGroups:
    """An xdist worker's side of tests/work_groups.py: the module -> unit map written for
    the controller; the Ray-free tests told to keep to one CPU."""

    def __init__(self, path: str) -> None:
        self.path = path

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, session, config, items):
        from suite_order import OWN_RAY, module_of, module_ranks, work_group
        from work_groups import write_groups

        ranks = module_ranks(items)
        config.stash[MODULE_RANKS] = ranks
        write_groups(self.path, {m: work_group(r, m) for m, r in ranks.items()})
        for item in items:
            item.stash[ONE_CPU] = ranks[module_of(item)] < OWN_RAY


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, per worker: where the worker writes its module -> unit map."""
    node.workerinput[WORK_GROUPS_KEY] = str(node.config.stash[WORK_GROUPS_PATH])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from work_groups import WorkGroupScheduling

    return WorkGroupScheduling(config, log, str(config.stash[WORK_GROUPS_PATH]))


WORK_GROUPS_KEY = "raylm_work_groups"
WORK_GROUPS_PATH = pytest.StashKey[str]()
MODULE_RANKS = pytest.StashKey[dict]()
ONE_CPU = pytest.StashKey[bool]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    from suite_order import sort_by_topology, sort_for_workers

    if MODULE_RANKS in config.stash:
        sort_for_workers(items, config.stash[MODULE_RANKS])
    else:
        sort_by_topology(items)


@pytest.fixture(autouse=True)
def _one_cpu_beside_ray(request, monkeypatch):
    """Under two xdist workers a Ray-free test runs its engines and oracles on one torch
    thread: the other CPU is the shared-Ray worker's (two 2-thread OpenMP teams on two
    cores spin against each other)."""
    if not request.node.stash.get(ONE_CPU, False):
        yield
        return
    import torch

    monkeypatch.setenv("RAYLM_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


RAY_INSTANCES = pytest.StashKey["object"]()


def pytest_addoption(parser):
    parser.addini("suite_time_budget_s", "the whole suite's wall-time budget on CI, seconds",
                  default="1500")


def pytest_sessionstart(session):
    session.config.stash[SUITE_START] = time.monotonic()


def _whole_suite_on_ci(config) -> bool:
    """The README's command on CI: no paths or -k/-m selection, CI=true."""
    return (os.environ.get("CI") == "true"
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and not config.option.keyword and not config.option.markexpr)


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when the whole suite on CI took longer than its budget: a slow
    suite is caught the day it grows, not when CI's own limit cuts it off."""
    wall = time.monotonic() - session.config.stash[SUITE_START]
    budget = float(session.config.getini("suite_time_budget_s"))
    session.config.stash[SUITE_WALL] = wall
    if _xdist_worker(session.config):  # to the controller's summary
        instances = session.config.stash[RAY_INSTANCES]
        session.config.workeroutput["ray_inits"] = instances.inits
        session.config.workeroutput["ray_killed"] = instances.killed
        return
    if _whole_suite_on_ci(session.config) and wall > budget and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


SUITE_START = pytest.StashKey[float]()
SUITE_WALL = pytest.StashKey[float]()


def pytest_configure(config):
    from ray_instances import RayInstances

    if _xdist_worker(config) and WORK_GROUPS_KEY in config.workerinput:
        config.pluginmanager.register(WorkGroups(config.workerinput[WORK_GROUPS_KEY]),
                                      "raylm-work-groups")
    elif not _xdist_worker(config):
        import tempfile

        config.stash[WORK_GROUPS_PATH] = os.path.join(tempfile.mkdtemp(prefix="raylm-units-"),
                                                      "groups.json")

    instances = RayInstances()
    instances.install_counter()  # from the start: the product's own ray.init counts too
    config.stash[RAY_INSTANCES] = instances


def pytest_unconfigure(config):
    instances = config.stash.get(RAY_INSTANCES, None)
    if instances is not None:
        instances.close()
        instances.uninstall_counter()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: a worker's Ray instances join the run's count."""
    instances = node.config.stash[RAY_INSTANCES]
    output = getattr(node, "workeroutput", {})
    instances.inits.extend(f"[{node.gateway.id}] {line}" for line in output.get("ray_inits", []))
    instances.killed.extend(output.get("ray_killed", []))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.config.stash[RAY_INSTANCES].test = item.nodeid


@pytest.fixture(scope="session")
def ray_instances(request):
    return request.config.stash[RAY_INSTANCES]


def _shared(ray_instances, topology: str, start):
    instance = ray_instances.use(topology, start)
    yield instance
    ray_instances.end_module()


@pytest.fixture(scope="module")
def ray_local(ray_instances):
    """The run's single-node Ray with LOCAL_CPUS logical CPUs and no GPU; Serve apps on
    it through ``instance.serve_app``."""
    from ray_instances import start_local

    yield from _shared(ray_instances, "local", lambda: start_local(LOCAL_CPUS))


@pytest.fixture(scope="module")
def ray_gpu_node(ray_instances):
    """A single-node Ray whose node declares 2 GPUs (this machine has none) and 3 CPUs."""
    from ray_instances import start_local

    yield from _shared(ray_instances, "gpu_node",
                       lambda: start_local(3, num_gpus=2, topology="gpu_node"))


@pytest.fixture(scope="module")
def ray_gpu_nodes(ray_instances):
    """A head without GPUs (2 CPUs) and two nodes of 1 CPU and 3 GPUs each."""
    from ray_instances import start_cluster

    yield from _shared(ray_instances, "gpu_nodes", lambda: start_cluster(
        "gpu_nodes", {"num_cpus": 2, "num_gpus": 0}, [{"num_cpus": 1, "num_gpus": 3}] * 2))


@pytest.fixture(scope="module")
def ray_two_nodes(ray_instances):
    """A head and a worker node of one CPU each (``instance.cluster`` is Ray's Cluster)."""
    from ray_instances import start_cluster

    yield from _shared(ray_instances, "two_nodes", lambda: start_cluster(
        "two_nodes", {"num_cpus": 1, "include_dashboard": False}, [{"num_cpus": 1}]))


@pytest.fixture(scope="module")
def ray_multinode(ray_instances):
    """tests/cluster/multinode.py's LocalCluster (``ray start`` processes) of a head and two
    worker nodes, node_a and node_b, of one CPU each (``instance.cluster``)."""
    def start():
        from multinode import LocalCluster, NodeSpec
        from ray_instances import FAST_SERVE_METRICS, RayInstance

        fast = {**FAST_SERVE_METRICS, "RAY_health_check_period_ms": "1000",
                "RAY_health_check_failure_threshold": "3",
                "RAY_health_check_initial_delay_ms": "1000",  # node death seen in seconds
                # Each node would read the whole machine's memory, the rest of the suite's
                # processes included, and kill its own newest workers for them.
                "RAY_memory_monitor_refresh_ms": "0"}
        workers = [NodeSpec(n, 1, resources={n: 1, "replica_slot": 1}, env=fast)
                   for n in ("node_a", "node_b")]
        cluster = LocalCluster(NodeSpec("head", 1, resources={"head": 1}, env=fast), workers)
        cluster.start()
        return RayInstance("multinode", cluster.shutdown, cluster=cluster)

    yield from _shared(ray_instances, "multinode", start)


@pytest.fixture(scope="module")
def ray_none(ray_instances):
    """No Ray of the run's: for a test that starts and stops a cluster of its own (the
    soak's), after every shared one."""
    ray_instances.close()
    yield
    import ray

    assert not ray.is_initialized(), "the module left its Ray connected"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    wall = config.stash.get(SUITE_WALL, None)
    if wall is not None:
        budget = float(config.getini("suite_time_budget_s"))
        over = wall > budget and _whole_suite_on_ci(config)
        terminalreporter.write_sep("=", f"suite wall time {wall:.0f} s, budget {budget:.0f} s"
                                   f" (suite_time_budget_s in pyproject.toml)"
                                   f"{': OVER BUDGET, the run fails' if over else ''}",
                                   red=over)
    instances = config.stash.get(RAY_INSTANCES, None)
    inits = instances.inits if instances is not None else []
    terminalreporter.write_sep("=", f"Ray instances started or joined by this run: {len(inits)}")
    for line in inits:
        terminalreporter.write_line(f"  ray.init from {line}")
    for line in instances.killed if instances is not None else []:
        terminalreporter.write_line(f"  actors left alive by a module, killed after it: {line}")

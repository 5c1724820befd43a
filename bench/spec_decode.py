"""Speculative decoding: output tok/s and mean acceptance length, speculation off vs ngram
vs a draft model vs an EAGLE-3 head.

    python bench/spec_decode.py [--k 3] [--batches 1,4,32] [--repeats 3]
        [--workloads copy,miss,smollm2] [--methods ngram,draft_model,eagle]
        [--eagle-head DIR] [--disable-by-batch-size 8] [--dtype auto]

Workloads (greedy, ignore_eos; copy and miss on 6m-size random-weight Llama checkpoints
written locally):
- copy: requests that quote a passage of their prompt. A random model never quotes, so
  this one is the 6m checkpoint with its attention output scaled down 10^5x: its next
  token is a function of the current one, so it continues a passage the way it continued
  it before. Each prompt is 32 random tokens S, the 128 tokens P this model generated
  from S (once, before timing), and S again: the output quotes P, and prompt lookup finds
  it from the repeated S on. 128 output tokens. (An earlier version scaled attention by
  1/250 and quoted nothing explicitly, relying on the text falling into loops; whether it
  did turned on float rounding, which the CPU kernels changed.)
- miss: the plain random checkpoint (text that almost never repeats): drafts miss, and
  the per-request draft gate turns speculation off for the requests it cannot help.
  32-token prompts, 64 output tokens.
- smollm2: the default model (SmolLM2-135M-Instruct) answering chat-templated
  instructions (bench/eagle_data.py's templates, none of bench/train_eagle.py's training
  ones): ordinary text that does not quote its prompt. 128 output tokens. The ``eagle``
  method (an EAGLE-3 head, --eagle-head, from bench/train_eagle.py) runs on this workload
  only; its column is empty (nan) on the others.
Each batch size b runs b requests at once (max_num_seqs=b). Every method runs with
disable_by_batch_size=8 (--disable-by-batch-size, 0: never): a step of more requests
drafts nothing; with 0 the per-request draft gate alone decides.
The engines of one row (off and each method) live in this process side by side and
are timed in turns (off, ngram, draft, off, ...) after a warm-up turn, so a change of
load on a shared machine hits them alike: tok/s is the median of --repeats runs, the
ratio to off the median of the per-turn ratios. "cpu x" is the same ratio of this
process's CPU time (all its threads): on an oversubscribed box wall time mostly measures
the other work, CPU time the work this engine did for its tokens.
accept_len is the mean number of tokens a verifying step emits (1 + accepted drafts).
The draft model is a 1-layer random checkpoint with the target's vocabulary (hidden 64):
it predicts neither target, so its row shows what drafting costs when it cannot win and
the draft gate has to switch it off (there is no trained small model to draft with here).
Every run checks that speculation left the tokens unchanged: exactly in float32 (--dtype
float32); in bfloat16 (``auto`` on a CPU with native bf16) a verifying step's multi-row
matmuls round differently from a one-row decode, so a near-tie may flip: the "same" column
then counts the requests whose tokens equal speculation off's, and the run fails only in
float32.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import CACHE, Timer, checkpoint  # noqa: E402

KV_BYTES = 64 << 20  # per engine: the engines of one row live side by side


def copy_checkpoint() -> str:
    """The 6m checkpoint with attention output scaled down (see the module docstring)."""
    path = os.path.join(CACHE, "llama-6m-quote")
    weights_file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights_file):
        import shutil

        from raylm.runner.loading.checkpoint import scale_attention_output

        shutil.copytree(checkpoint("6m"), path, dirs_exist_ok=True)
        scale_attention_output(path, 1e-5)
    return path


def draft_checkpoint() -> str:
    from raylm.runner.loading.checkpoint import SPECS, CheckpointSpec, write_random_checkpoint

    path = os.path.join(CACHE, "llama-draft-1layer")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        write_random_checkpoint(path, CheckpointSpec(
            vocab_size=SPECS["6m"].vocab_size, hidden_size=64, intermediate_size=128,
            num_hidden_layers=1, max_position_embeddings=2048, seed=11))
    return path


def make_prompts(path: str, batch: int, prompt_len: int, quote_len: int) -> list[dict]:
    from raylm import LLM, SamplingParams

    rng = random.Random(batch)
    with LLM(path, max_num_seqs=batch, enable_prefix_caching=False,
             kv_cache_memory_bytes=KV_BYTES) as llm:
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(prompt_len)]}
                   for _ in range(batch)]
        if quote_len:  # S, the model's continuation of S, S again: the output quotes it
            quoted = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=quote_len,
                                                          ignore_eos=True, detokenize=False),
                                  use_tqdm=False)
            prompts = [{"prompt_token_ids": (p["prompt_token_ids"] + q.outputs[0].token_ids
                                             + p["prompt_token_ids"])}
                       for p, q in zip(prompts, quoted, strict=True)]
    return prompts


def run(path: str, batch: int, prompts: list[dict], out_len: int,
        specs: dict[str, dict | None], repeats: int, kv_bytes: int = KV_BYTES,
        dtype: str = "auto") -> dict[str, tuple[float, float, float, float, list[list[int]]]]:
    """Per engine: (tok/s, tok/s ratio to "off", accept_len, CPU-time ratio to "off",
    tokens). The engines are timed in turns (off, ngram, draft, off, ...), so a change of
    machine load hits them alike; a ratio is the median of the per-turn ratios."""
    from raylm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True,
                            detokenize=False)
    llms = {name: LLM(path, max_num_seqs=batch, enable_prefix_caching=False,
                      kv_cache_memory_bytes=kv_bytes, speculative_config=spec, dtype=dtype)
            for name, spec in specs.items()}
    tokens: dict[str, list[list[int]]] = {}
    seconds: dict[str, list[float]] = {name: [] for name in llms}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in llms}
    for turn in range(repeats + 1):  # turn 0 warms up
        for name, llm in llms.items():
            cpu = time.process_time()
            with Timer() as t:
                outs = llm.generate(prompts, params, use_tqdm=False)
            cpu = time.process_time() - cpu
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            assert sum(len(x) for x in tokens[name]) == batch * out_len
            if turn:
                seconds[name].append(t.seconds)
                cpu_seconds[name].append(cpu)
    results = {}
    for name, llm in llms.items():
        m = llm.get_metrics()  # (the warm-up turn drafts too; it is counted in accept_len)
        drafts = m.get("raylm:spec_decode_num_drafts", 0)
        accept_len = 1 + m["raylm:spec_decode_num_accepted_tokens"] / drafts if drafts else 1.0
        llm.shutdown()
        ratio = statistics.median(o / s for o, s in zip(seconds["off"], seconds[name],
                                                        strict=True))
        cpu_ratio = statistics.median(o / s for o, s in zip(cpu_seconds["off"],
                                                            cpu_seconds[name], strict=True))
        results[name] = (batch * out_len / statistics.median(seconds[name]), ratio, accept_len,
                         cpu_ratio, tokens[name])
    return results


def smollm2_prompts(batch: int, head_dir: str | None = None) -> list[dict]:
    """Chat-templated instructions for the default model (bench/eagle_data.py's templates,
    none of those the head at ``head_dir`` was trained on): answers that do not quote the
    prompt."""
    import eagle_data

    path = checkpoint("smollm2")
    trained = eagle_data.training_instructions(head_dir)
    texts = eagle_data.make_instructions(batch, 1000 + batch, trained)
    return [{"prompt_token_ids": p} for p in eagle_data.chat_prompts(path, texts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--batches", default="1,4,32")
    ap.add_argument("--workloads", default="copy,miss")
    ap.add_argument("--methods", default="ngram,draft_model",
                    help="of ngram, draft_model, eagle (eagle: smollm2 workload only)")
    ap.add_argument("--eagle-head", default=os.path.expanduser("~/.cache/raylm/eagle3-smollm2"),
                    help="an EAGLE-3 head for SmolLM2 (bench/train_eagle.py writes one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disable-by-batch-size", type=int, default=8,
                    help="speculative_config.disable_by_batch_size (0: never)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--draft-step-overhead-tokens", type=float, default=None,
                    help="speculative_config.draft_step_overhead_tokens (default: the "
                         "engine's)")
    args = ap.parse_args()
    args.disable_by_batch_size = args.disable_by_batch_size or None
    gate = ({} if args.draft_step_overhead_tokens is None
            else {"draft_step_overhead_tokens": args.draft_step_overhead_tokens})
    common = {"num_speculative_tokens": args.k,
              "disable_by_batch_size": args.disable_by_batch_size, **gate}
    methods = args.methods.split(",")
    specs_all = {
        "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                  **common},
        "draft_model": {"method": "draft_model", "model": draft_checkpoint()
                        if "draft_model" in methods else None, **common},
        "eagle": {"method": "eagle3", "model": args.eagle_head, **common},
    }
    # (name, checkpoint, prompt maker, output length, KV bytes per engine)
    workloads = [w for w in [
        ("copy", copy_checkpoint, lambda p, b: make_prompts(p, b, 32, 128), 128, KV_BYTES),
        ("miss", lambda: checkpoint("6m"), lambda p, b: make_prompts(p, b, 32, 0), 64,
         KV_BYTES),
        ("smollm2", lambda: checkpoint("smollm2"), lambda p, b: smollm2_prompts(b, args.eagle_head), 128,
         512 << 20)] if w[0] in args.workloads.split(",")]
    head = f"| {'workload':<8} | {'batch':>5} | {'off tok/s':>9} |"
    rule = f"|{'-' * 10}|{'-' * 7}|{'-' * 11}|"
    for m in methods:
        head += (f" {m + ' tok/s':>17} | {'speedup':>7} | {'cpu x':>7} | {'accept_len':>10} |"
                 f" {'same':>7} |")
        rule += f"{'-' * 19}|{'-' * 9}|{'-' * 9}|{'-' * 12}|{'-' * 9}|"
    print(head + "\n" + rule, flush=True)
    summary = []
    for name, make_path, make, out_len, kv_bytes in workloads:
        path = make_path()
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = make(path, batch)
            # the EAGLE head is SmolLM2's: other workloads leave its column empty
            specs = {"off": None, **{m: specs_all[m] for m in methods
                                     if m != "eagle" or name == "smollm2"}}
            res = run(path, batch, prompts, out_len, specs, args.repeats, kv_bytes, args.dtype)
            if args.dtype == "float32":
                for m in specs:
                    assert res[m][4] == res["off"][4], (
                        f"{name} batch {batch}: {m} changed the tokens")
            line = f"| {name:<8} | {batch:>5} | {res['off'][0]:>9.1f} |"
            for m in methods:
                tps, x, accept_len, cpu = res[m][:4] if m in res else (float("nan"),) * 4
                same = (f"{sum(a == b for a, b in zip(res[m][4], res['off'][4]))}/{batch}"
                        if m in res else "-")
                line += (f" {tps:>17.1f} | {x:>6.2f}x | {cpu:>6.2f}x | {accept_len:>10.2f} |"
                         f" {same:>7} |")
            print(line, flush=True)
            if batch == 1 and name == "copy" and "ngram" in res:
                summary.append(f"spec: batch1 off={res['off'][0]:.1f} "
                               f"ngram={res['ngram'][0]:.1f} speedup={res['ngram'][1]:.2f}x "
                               f"accept_len={res['ngram'][2]:.2f}")
            if batch == 1 and name == "smollm2":
                summary.append(f"spec: smollm2 batch1 off={res['off'][0]:.1f} " + " ".join(
                    f"{m}={res[m][0]:.1f} speedup={res[m][1]:.2f}x accept_len={res[m][2]:.2f}"
                    for m in methods if m in res))
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()

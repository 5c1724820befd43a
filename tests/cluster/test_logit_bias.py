"""logit_bias (OpenAI's and vLLM's semantics): added to the logits after the raw logprobs and
before penalties and sampling. Checked against transformers with the same bias on its
logits, sync against async scheduling (greedy and seeded), and through the HTTP server."""

from __future__ import annotations

import pytest
import torch
from test_openai_fakes import real_engine_client

from raylm import LLM, SamplingParams
from raylm.runner.sample.sampler import Sampler, SamplingMetadata

PROMPT = [5, 9, 200, 31, 77, 140, 12]
# Moderate biases: they change the greedy path without pinning one token.
BIAS = {17: 0.5, 300: 0.8, 451: -1.0, 64: 0.6, 222: 0.7, 95: -0.5}


class _AddBias:
    """A transformers logits processor adding ``bias`` (token -> value)."""

    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(list(bias))
        self.values = torch.tensor(list(bias.values()))

    def __call__(self, input_ids, scores):
        scores[:, self.ids] += self.values
        return scores


def _hf_greedy(path: str, prompt: list[int], n: int, bias: dict[int, float]) -> list[int]:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0,
                             logits_processor=LogitsProcessorList([_AddBias(bias)]))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def engines(llama_path):
    sync, async_ = LLM(llama_path, async_scheduling=False), LLM(llama_path, async_scheduling=True)
    yield sync, async_
    sync.shutdown()
    async_.shutdown()


def _tokens(llm: LLM, params: SamplingParams, prompts=(PROMPT,)) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_with_bias_equals_transformers(engines, llama_path):
    sync, _ = engines
    n = 24
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logit_bias=BIAS)
    (biased,) = _tokens(sync, params)
    (plain,) = _tokens(sync, params.clone(logit_bias=None))
    assert biased != plain  # the bias changes the path ...
    assert biased == _hf_greedy(llama_path, PROMPT, n, BIAS)  # ... exactly as transformers'


def test_sync_and_async_give_identical_tokens(engines):
    sync, async_ = engines
    prompts = [PROMPT, PROMPT[:3], [7, 7, 7, 300]]
    for params in (SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logit_bias=BIAS),
                   SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True,
                                  logit_bias={t: 4 * v for t, v in BIAS.items()}),
                   SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=5, n=2,
                                  ignore_eos=True, logit_bias={300: 100})):
        assert _tokens(sync, params, prompts) == _tokens(async_, params, prompts)


def test_plus_100_forces_and_minus_100_bans(engines):
    sync, _ = engines
    (forced,) = _tokens(sync, SamplingParams(max_tokens=6, temperature=1.0, seed=1,
                                             ignore_eos=True, logit_bias={300: 100}))
    assert forced == [300] * 6
    (plain,) = _tokens(sync, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    banned = {t: -100.0 for t in set(plain)}
    (other,) = _tokens(sync, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                            logit_bias=banned))
    assert not set(other) & set(plain)


def test_sampler_adds_the_bias_after_the_raw_logprobs():
    logits = torch.zeros(3, 8)
    md = SamplingMetadata(temperature=None, all_greedy=True, all_random=False, is_greedy=None,
                          top_k=None, top_p=None, min_p=None, seeds=None, positions=None,
                          bias_rows=torch.tensor([0, 2, 2]), bias_tokens=torch.tensor([5, 1, 6]),
                          bias_values=torch.tensor([1.0, 2.0, 3.0]), max_num_logprobs=1)
    out = Sampler(8, torch.device("cpu"))(logits, md)
    assert out.sampled_token_ids[:, 0].tolist() == [5, 0, 6]
    # Logprobs are the model's raw ones (vLLM's default), unbiased: uniform here.
    assert torch.allclose(out.logprobs_tensors.logprobs[:, 0], torch.log(torch.tensor(1 / 8)))


def test_logit_bias_through_the_server(llama_path, engines):
    with real_engine_client(llama_path, "m", max_num_seqs=4) as client:
        r = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0,
                                      logit_bias={str(t): v for t, v in BIAS.items()},
                                      extra_body={"ignore_eos": True})
    sync, _ = engines
    (offline,) = _tokens(sync, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                              logit_bias=BIAS))
    assert r.choices[0].text == sync.get_tokenizer().decode(offline)

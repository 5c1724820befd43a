"""Detokenization, stop strings, logprobs and n>1 gathering, without an engine."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from raylm.cluster.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from raylm.cluster.engine.output_processor import OutputProcessor, ParentRequest
from raylm.cluster.engine.outputs import RequestMetrics
from raylm.scheduler.core_outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LogprobsLists,
)
from raylm.scheduler.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def tokenizer(llama_path):
    return AutoTokenizer.from_pretrained(llama_path)


def _parent(tokenizer, text, params, request_id="r"):
    ids = tokenizer(text).input_ids
    return ParentRequest(request_id, text, ids, params, RequestMetrics(0.0))


def test_incremental_text_equals_full_decode(tokenizer):
    text = "The quick brown fox jumps over the lazy dog 123! Hello world: ümlaut ✓ 漢字"
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(), prompt_token_ids=[1])
    for t in ids:
        assert detok.update(t) is None
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_fast_decoder_returns_the_tokenizers_text(tokenizer):
    ids = tokenizer("Hello world: ümlaut ✓ 漢字 , . !").input_ids + [tokenizer.eos_token_id]
    decode = fast_decoder(tokenizer)
    assert decode is not tokenizer.decode  # the Rust decode, without the wrapper
    for skip in (True, False):
        assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(
            ids, skip_special_tokens=skip)
    # A tokenizer that post-processes the text keeps its own decode.
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert fast_decoder(tokenizer) == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = False


def test_stop_string_trims_and_asks_for_abort(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["lazy"], max_tokens=50)
    proc.add_request(_parent(tokenizer, "x", params), ["r"])
    ids = tokenizer("the quick brown fox jumps over the lazy dog").input_ids
    outs, abort = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("r", ids)]))
    assert abort == ["r"]
    (out,) = outs
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == "lazy"
    assert out.outputs[0].text == "the quick brown fox jumps over the "
    # Tokens after the one that completed the stop string are not kept.
    assert tokenizer.decode(out.outputs[0].token_ids).endswith("lazy")
    # Late tokens still in flight for it are dropped, not delivered.
    late, _ = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("r", [5, 6])]))
    assert late == []


def test_include_stop_str_and_min_tokens(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["fox"], include_stop_str_in_output=True, max_tokens=50)
    proc.add_request(_parent(tokenizer, "x", params), ["r"])
    ids = tokenizer("the fox runs").input_ids
    (out,), _ = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("r", ids)]))
    assert out.outputs[0].text == "the fox"
    # min_tokens: a stop string inside the first min_tokens tokens does not stop.
    proc2 = OutputProcessor(tokenizer)
    params2 = SamplingParams(stop=["the"], min_tokens=len(tokenizer("the dog").input_ids) + 1, max_tokens=50)
    proc2.add_request(_parent(tokenizer, "x", params2), ["r"])
    ids2 = tokenizer("the dog").input_ids
    (out2,), abort2 = proc2.process_outputs(EngineCoreOutputs([EngineCoreOutput("r", ids2)]))
    assert not out2.finished and abort2 == []


def test_streamed_text_holds_back_partial_stop_string(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["jumps over"], max_tokens=50)
    proc.add_request(_parent(tokenizer, "x", params), ["r"])
    seen = []
    ids = tokenizer("the fox jumps over it").input_ids
    for t in ids:
        outs, _ = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("r", [t])]))
        if outs:
            seen.append(outs[0].outputs[0].text)
    # Streamed text only grows, never shows a prefix of the stop string it later drops.
    for a, b in zip(seen, seen[1:]):
        assert b.startswith(a)
    assert seen[-1] == "the fox "
    assert all("jump" not in s for s in seen)


def test_length_finish_and_logprobs(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=2, logprobs=2)
    proc.add_request(_parent(tokenizer, "x", params), ["r"])
    lp = LogprobsLists(token_ids=[[10, 10, 11], [12, 13, 12]],
                       logprobs=[[-0.5, -0.5, -1.5], [-2.0, -0.1, -2.0]],
                       sampled_token_ranks=[1, 2])
    out = EngineCoreOutput("r", [10, 12], new_logprobs=lp, finish_reason=FinishReason.LENGTH)
    (res,), _ = proc.process_outputs(EngineCoreOutputs([out]))
    c = res.outputs[0]
    assert c.finish_reason == "length" and c.token_ids == [10, 12]
    assert [sorted(d) for d in c.logprobs] == [[10, 11], [12, 13]]
    assert c.logprobs[0][10].rank == 1 and c.logprobs[1][12].rank == 2
    assert c.logprobs[1][13].rank == 1
    assert c.cumulative_logprob == pytest.approx(-2.5)
    assert not proc.has_unfinished()


def test_n_children_are_gathered_in_one_output(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=1)
    proc.add_request(_parent(tokenizer, "x", params, "p"), ["0_p", "1_p"])
    outs, _ = proc.process_outputs(EngineCoreOutputs([
        EngineCoreOutput("0_p", [20], finish_reason=FinishReason.LENGTH)]))
    assert not outs[0].finished
    outs, _ = proc.process_outputs(EngineCoreOutputs([
        EngineCoreOutput("1_p", [21], finish_reason=FinishReason.LENGTH)]))
    (res,) = outs
    assert res.finished and [c.token_ids for c in res.outputs] == [[20], [21]]
    assert [c.index for c in res.outputs] == [0, 1]
    assert not proc.has_unfinished()


def test_an_abort_from_the_engine_is_an_error_and_a_client_abort_is_not(tokenizer):
    """The engine finishes the requests it holds with ABORT when it dies (a killed worker):
    such an output carries an error, so the server answers with one instead of a 200
    holding a truncated text (bench/soak.py found it). A client's own abort stays clean."""
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=8)
    proc.add_request(_parent(tokenizer, "x", params, "p"), ["0_p", "1_p"])
    proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("0_p", [20]),
                                            EngineCoreOutput("1_p", [21])]))
    (res,), _ = proc.process_outputs(EngineCoreOutputs([
        EngineCoreOutput("0_p", [], finish_reason=FinishReason.ABORT),
        EngineCoreOutput("1_p", [], finish_reason=FinishReason.ABORT)]))
    assert res.finished and res.error and "aborted" in res.error
    assert [c.finish_reason for c in res.outputs] == ["abort", "abort"]
    proc.add_request(_parent(tokenizer, "x", SamplingParams(max_tokens=8), "q"), ["q"])
    proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("q", [20])]))
    final = proc.abort_request("q")  # the client's: the engine's ABORT comes too late
    assert final.finished and final.error is None
    assert proc.process_outputs(EngineCoreOutputs([
        EngineCoreOutput("q", [], finish_reason=FinishReason.ABORT)])) == ([], [])


def test_detokenize_false_keeps_ids_and_skips_text(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=3, detokenize=False, logprobs=0)
    proc.add_request(_parent(tokenizer, "x", params), ["r"])
    lp = LogprobsLists(token_ids=[[40], [41], [42]], logprobs=[[-1.0], [-2.0], [-3.0]],
                       sampled_token_ranks=[3, 1, 2])
    out = EngineCoreOutput("r", [40, 41, 42], new_logprobs=lp, finish_reason=FinishReason.LENGTH)
    (res,), _ = proc.process_outputs(EngineCoreOutputs([out]))
    c = res.outputs[0]
    assert c.token_ids == [40, 41, 42] and c.text == ""
    assert [e[t].decoded_token for e, t in zip(c.logprobs, c.token_ids)] == [None] * 3
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def _stream(tokenizer, kind, text, **params):
    """Feed ``text``'s tokens one per step to a request of output kind ``kind``."""
    proc = OutputProcessor(tokenizer)
    ids = tokenizer(text).input_ids
    sp = SamplingParams(max_tokens=len(ids), logprobs=0, output_kind=kind, **params)
    proc.add_request(_parent(tokenizer, "x", sp), ["r"])
    outs = []
    for i, t in enumerate(ids):
        lp = LogprobsLists(token_ids=[[t]], logprobs=[[-float(i)]], sampled_token_ranks=[1])
        last = FinishReason.LENGTH if i == len(ids) - 1 else None
        step, _ = proc.process_outputs(EngineCoreOutputs([
            EngineCoreOutput("r", [t], new_logprobs=lp, finish_reason=last)]))
        outs += step
        if step and step[0].finished:
            break
    assert not proc.has_unfinished()
    return ids, outs


@pytest.mark.parametrize("stop", [(), ("jumps over",)])
def test_delta_outputs_add_up_to_the_cumulative_ones(tokenizer, stop):
    text = "the quick brown fox jumps over the lazy dog ✓ 漢字"
    _, cumulative = _stream(tokenizer, RequestOutputKind.CUMULATIVE, text, stop=stop)
    ids, delta = _stream(tokenizer, RequestOutputKind.DELTA, text, stop=stop)
    assert len(delta) == len(cumulative)
    for n, (d, c) in enumerate(zip(delta, cumulative), 1):
        assert d.finished == c.finished
        assert "".join(o.outputs[0].text for o in delta[:n]) == c.outputs[0].text
        assert sum((o.outputs[0].token_ids for o in delta[:n]), []) == c.outputs[0].token_ids
        assert sum((o.outputs[0].logprobs for o in delta[:n]), []) == c.outputs[0].logprobs
    assert len(delta[0].outputs[0].token_ids) == 1  # one step's token, not everything so far
    final = cumulative[-1].outputs[0]
    assert final.finish_reason == ("stop" if stop else "length")
    if not stop:
        assert final.token_ids == ids


def test_final_only_outputs_only_the_finished_request(tokenizer):
    text = "the quick brown fox jumps over the lazy dog"
    ids, outs = _stream(tokenizer, RequestOutputKind.FINAL_ONLY, text)
    (out,) = outs
    assert out.finished and out.outputs[0].token_ids == ids
    assert out.outputs[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(out.outputs[0].logprobs) == len(ids)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=1)

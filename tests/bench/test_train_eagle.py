"""bench/train_eagle.py's head on a tiny random Llama: a few training steps lower the loss,
the saved head loads through raylm (greedy tokens unchanged by its drafts) and the
trainer's step-0 and chained (training-time test) drafts are those of
tests/eagle_heads.ReferenceHead, the plain-torch reference of the engine's head math."""

from __future__ import annotations

import json
import os
import random
import sys
from collections import Counter

import pytest
import torch
from eagle_heads import ReferenceHead

from raylm.runner.loading.checkpoint import CheckpointSpec, write_random_checkpoint
from raylm.runner.loading.eagle_checkpoint import aux_layer_ids

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import eagle_data  # noqa: E402
import train_eagle  # noqa: E402

STEPS = 2


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("eagle_target")),
                                   CheckpointSpec(num_hidden_layers=4, vocab_size=256, seed=3))


def test_trained_head_saves_loads_and_matches_the_reference(target, tmp_path):
    torch.manual_seed(0)
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    aux = aux_layer_ids(cfg["num_hidden_layers"])
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(5, 12))] for _ in range(8)]
    outputs = eagle_data.generate(target, prompts, 16, ignore_eos=True)
    assert [len(o) for o in outputs] == [16] * 8
    seqs = eagle_data.target_features(target, prompts, outputs, aux, top_k=4)
    assert seqs[0].aux.shape == (len(prompts[0]) + 16, 3 * cfg["hidden_size"])
    vocab = train_eagle.DraftVocab(Counter(t for o in outputs for t in o), 64, 256)
    assert torch.equal(vocab.ids[vocab.to_draft[vocab.ids]], vocab.ids)
    head = train_eagle.build_head(target, cfg, vocab)
    batches = train_eagle.make_batches(seqs, 64, STEPS, vocab)
    with torch.no_grad():
        before = sum(float(train_eagle.batch_loss(head, b, vocab, STEPS)[0]) for b in batches)
    train_eagle.train(head, batches, vocab, STEPS, seconds=3.0, lr=3e-3, log=lambda _: None)
    with torch.no_grad():
        after = sum(float(train_eagle.batch_loss(head, b, vocab, STEPS)[0]) for b in batches)
    assert after < 0.9 * before, (before, after)
    out = train_eagle.save_head(head, vocab, cfg, aux, str(tmp_path / "head"))

    # Through raylm: the head loads and drafts, and greedy tokens stay the target's.
    equal, accept_len, drafts = train_eagle.raylm_check(target, out, prompts[:3], 12, k=2)
    assert equal and drafts > 0 and accept_len >= 1.0, (equal, accept_len, drafts)

    # The trainer's drafts after a history = the reference's from the saved files.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    reference = ReferenceHead(out, model, "eagle3")
    with torch.no_grad():
        for seq in seqs[:4]:
            history = seq.ids[:len(seq.ids) - 3].tolist()
            expected = reference.drafts(history, STEPS)
            ids = torch.tensor(history + expected[:1])
            hs = model(ids[None], output_hidden_states=True).hidden_states
            features = torch.cat([hs[i] for i in aux], -1)
            outs = head.unrolled(ids[None], features, STEPS)
            anchor = len(history) - 2  # the pair (history[-1], feature at len - 2)
            got = [int(vocab.ids[head.logits(o[0, anchor]).argmax()]) for o in outs]
            assert got == expected, (len(history), got, expected)

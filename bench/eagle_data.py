"""Training data for bench/train_eagle.py: instructions made here from templates and word
lists (nothing downloaded), the target's own greedy answers from raylm's offline ``LLM``,
and, from transformers in float32, the inputs of the three target layers EAGLE-3's ``fc``
reads and the target's next-token distribution (its top ``k``) at every position."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import torch

TOPICS = (
    "the sea", "a CPU", "Paris", "photosynthesis", "a bicycle", "rain", "chess", "the moon",
    "bread", "a violin", "volcanoes", "a library", "gravity", "tea", "honey bees",
    "the internet", "a steam engine", "coffee", "glaciers", "the Roman Empire",
    "electricity", "a vaccine", "democracy", "black holes", "recycling", "a rainbow",
    "the stock market", "sleep", "a compass", "football", "jazz", "a telescope", "bamboo",
    "sharks", "a hospital", "wind turbines", "the printing press", "yoga", "a desert",
    "penguins", "money", "an airplane", "a garden", "friendship", "the human heart",
    "a river", "climate change", "a smartphone", "chocolate", "the Olympic Games",
    "mountains", "a museum", "robots", "a birthday party", "earthquakes", "the alphabet",
    "cheese", "a train", "solar panels", "the ocean tides", "a forest", "a lighthouse",
    "music", "the brain", "a city park", "a bakery", "snow", "dinosaurs", "a camera",
    "time zones",
)
TASKS = (
    "rising early", "learning a language", "saving money", "writing an essay",
    "cooking rice", "staying focused", "making friends", "planning a trip",
    "keeping a plant alive", "running a meeting", "studying for an exam", "cleaning a room",
)
TEMPLATES = (
    "Explain how {t} works in simple terms.", "Tell me about {t}.",
    "Write a short story about {t}.", "Describe {t} to a child.",
    "What are three interesting facts about {t}?", "Write a short poem about {t}.",
    "List the pros and cons of {t}.", "Why is {t} important?",
    "Compare {t} and {u}.", "What is the history of {t}?",
    "Give me three tips for {task}.", "How do I get better at {task}?",
    "Write a friendly email inviting a colleague to talk about {t}.",
    "Summarize what people should know about {t} in a paragraph.",
)


def make_instructions(n: int, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct instructions (none in ``exclude``), from templates and word lists."""
    rng = random.Random(seed)
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        t, u = rng.sample(TOPICS, 2)
        text = rng.choice(TEMPLATES).format(t=t, u=u, task=rng.choice(TASKS))
        text = text[0].upper() + text[1:]
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


# Written beside a head by bench/train_eagle.py: which instructions it was trained on, so
# that a benchmark of the head leaves them out.
TRAINING_RECORD = "training.json"


def write_training_record(head_dir: str, num_prompts: int, seed: int) -> None:
    with open(os.path.join(head_dir, TRAINING_RECORD), "w") as f:
        json.dump({"prompts": num_prompts, "seed": seed}, f)


def training_instructions(head_dir: str | None) -> set[str]:
    """The instructions the head at ``head_dir`` was trained on (its record; without one,
    the training script's first defaults: 320 instructions, seed 0)."""
    record = {"prompts": 320, "seed": 0}
    path = os.path.join(head_dir, TRAINING_RECORD) if head_dir else ""
    if path and os.path.isfile(path):
        with open(path) as f:
            record = json.load(f)
    return set(make_instructions(int(record["prompts"]), int(record["seed"])))


def chat_prompts(path: str, instructions: list[str]) -> list[list[int]]:
    """The instructions, chat-templated by the model's tokenizer: token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [list(tok.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"])
            for text in instructions]


def generate(path: str, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False,
             **engine_args) -> list[list[int]]:
    """The target's greedy continuations (raylm's offline engine)."""
    from raylm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            detokenize=False)
    with LLM(path, max_num_seqs=min(64, len(prompts)), **engine_args) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@dataclass
class Sequence:
    ids: torch.Tensor  # [T] prompt + continuation
    prompt_len: int
    aux: torch.Tensor  # [T, 3H]: the inputs of the three aux layers at each position
    top_ids: torch.Tensor  # [T, k]: the target's top-k next tokens after each position
    top_probs: torch.Tensor  # [T, k]: their probabilities


@torch.inference_mode()
def target_features(path: str, prompts: list[list[int]], outputs: list[list[int]],
                    aux_layers: list[int], top_k: int = 8, batch_tokens: int = 2048
                    ) -> list[Sequence]:
    """Per sequence, from transformers (float32): ``hidden_states[i]`` (the input of layer
    i) for i in ``aux_layers`` and the top ``top_k`` of the next-token distribution."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = [p + o for p, o in zip(prompts, outputs, strict=True)]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    result: list[Sequence | None] = [None] * len(seqs)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(seqs[order[end]]) <= batch_tokens:
            end += 1
        rows = order[start:end]
        width = max(len(seqs[i]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, i in enumerate(rows):  # right padding: causal rows never see it
            ids[b, :len(seqs[i])] = torch.tensor(seqs[i])
            mask[b, :len(seqs[i])] = 1
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1)
        probs, top = out.logits.float().softmax(-1).topk(top_k, dim=-1)
        for b, i in enumerate(rows):
            n = len(seqs[i])
            result[i] = Sequence(ids[b, :n].clone(), len(prompts[i]), aux[b, :n].clone(),
                                 top[b, :n].clone(), probs[b, :n].clone())
        start = end
    return [s for s in result if s is not None]

"""``<think>...</think>`` reasoning split out of a chat answer into ``reasoning_content``.

Two of vLLM's parser names, for the two ways such models write it:

- ``deepseek_r1``: the chat template opens ``<think>`` itself, so the output starts inside
  the reasoning; everything up to ``</think>`` is reasoning (a leading ``<think>`` the
  model writes anyway is dropped), the rest is the answer (less the blank lines after the tag). Without
  ``</think>`` the whole output is reasoning (the model was cut off while thinking).
- ``qwen3``: the model writes both tags; only an output that starts with ``<think>``
  (after blanks) has reasoning, up to ``</think>``; any other output is all answer.

The splitter works on streamed text: it holds back a suffix that may be the start of a
tag, so a tag split across two chunks is still found, and the split is the same whether
the text comes in one piece or token by token.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")

Piece = tuple[str, str]  # ("reasoning" | "content", text)


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser {name!r} is unknown; choose one of "
                             f"{list(REASONING_PARSERS)}.")
        # "start": not yet known whether there is reasoning (qwen3) or whether a <think>
        # the model writes itself comes first (deepseek_r1).
        self.name = name
        self.state = "start"
        self.buf = ""

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        if self.state == "start":
            head = self.buf.lstrip()
            if START.startswith(head):  # "<thi", or only blanks so far: wait
                return out
            if head.startswith(START):
                self.buf, self.state = head[len(START):], "reasoning"
            else:
                self.state = "reasoning" if self.name == "deepseek_r1" else "content"
        if self.state == "reasoning":
            at = self.buf.find(END)
            if at < 0:
                keep = partial_tag_length(self.buf, END)
                emit, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return out + [("reasoning", emit)] if emit else out
            if at:
                out.append(("reasoning", self.buf[:at]))
            self.buf, self.state = self.buf[at + len(END):], "after"
        if self.state == "after":  # the blank lines between </think> and the answer
            self.buf = self.buf.lstrip()
            if not self.buf:
                return out
            self.state = "content"
        if self.state == "content" and self.buf:
            out.append(("content", self.buf))
            self.buf = ""
        return out

    def finish(self) -> list[Piece]:
        """The text still held back, once the output has ended."""
        text, self.buf = self.buf, ""
        if not text or self.state == "after":
            return []
        if self.state == "start":  # blanks, or a cut "<thi": no reasoning began
            return [("reasoning" if self.name == "deepseek_r1" else "content", text)]
        return [("reasoning" if self.state == "reasoning" else "content", text)]

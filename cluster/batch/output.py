"""The output of a batch run: shards written as rows finish, resumable, each row once.

Two shapes, chosen by ``--output``:

- a file (``out.jsonl``, ``s3://b/out.jsonl``): finished rows are checkpointed as shards in
  ``<output>.parts/``; at the end they are merged, in input order, into the one file (written
  whole, so a reader never sees half of it) and the parts are deleted;
- a folder (ends with ``/``, or exists as one): the shards are the output, ``part-*.jsonl``,
  rows in the order they finished (OpenAI's Batch API does not order its output either:
  ``custom_id`` is the key).

A row is complete once its output line is stored; a rerun with the same output reads what
is stored and runs only the other rows, so no ``custom_id`` is ever written twice.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from raylm.cluster.batch.fs import Location, resolve

logger = logging.getLogger(__name__)

PARTS_SUFFIX = ".parts"
SHARD_PREFIX = "part-"
SHARD_SUFFIX = ".jsonl"


class BatchOutput:
    def __init__(self, uri: str) -> None:
        self.location = resolve(uri)
        self.is_folder = uri.endswith("/") or self.location.is_dir()
        self.shards = self.location if self.is_folder else self.location.sibling(PARTS_SUFFIX)
        self._run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self._num_shards = 0

    @property
    def uri(self) -> str:
        return self.location.uri

    # -- what an earlier run left ------------------------------------------------------------
    def load_completed(self) -> tuple[dict[str, str], list[str]]:
        """(custom_id -> output line, lines of rows without a usable custom_id) stored by
        earlier runs: the shards, and for a file output the file itself."""
        sources = [loc for loc in self.shards.list_files() if _is_shard(loc)]
        if not self.is_folder and self.location.exists():
            sources.insert(0, self.location)
        by_id: dict[str, str] = {}
        keyless: list[str] = []
        for loc in sources:
            for no, line in enumerate(loc.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                custom_id = _stored_custom_id(line, loc.uri, no)
                if isinstance(custom_id, str):
                    by_id[custom_id] = line  # shards after the file: the newest wins
                else:
                    keyless.append(line)
        return by_id, keyless

    # -- this run --------------------------------------------------------------------------
    def write_shard(self, lines: list[str]) -> Location:
        assert lines, "an empty shard is never written"
        self._num_shards += 1
        name = f"{SHARD_PREFIX}{self._run_id}-{self._num_shards:05d}{SHARD_SUFFIX}"
        loc = self.shards.child(name)
        loc.write_text("".join(ln if ln.endswith("\n") else ln + "\n" for ln in lines))
        return loc

    def finalize(self, order: list[str | None]) -> None:
        """A file output: merge everything stored into the file, in input order (``order``
        holds each input row's custom_id, None for rows without one), then drop the parts.
        A folder output is complete as it stands."""
        if self.is_folder:
            return
        by_id, keyless = self.load_completed()
        lines = []
        pending_keyless = iter(keyless)
        for custom_id in order:
            line = by_id.get(custom_id) if custom_id is not None else next(pending_keyless, None)
            assert line is not None, f"row {custom_id!r} has no output line at the merge"
            lines.append(line if line.endswith("\n") else line + "\n")
        self.location.write_text("".join(lines))
        self.shards.delete_dir()


def _is_shard(loc: Location) -> bool:
    name = loc.path.rsplit("/", 1)[-1]
    return name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)


def _stored_custom_id(line: str, where: str, line_no: int) -> Any:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} line {line_no} is not JSON, so it is not the output of a "
                         f"batch run; pass another --output ({e}).") from e
    if not isinstance(row, dict) or "response" not in row:
        raise ValueError(f"{where} line {line_no} is not an OpenAI Batch output line; pass "
                         "another --output.")
    return row.get("custom_id")

"""Where a batch run reads and writes: local paths and URIs (``s3://``, ``gs://``, ...).

Every read and write of a batch run happens in its driver, so a local path means the
driver's machine (the head node under ``ray job submit``). URIs resolve with ``pyarrow.fs``
(credentials and endpoints from the environment, as the cloud SDKs read them), and the
schemes pyarrow does not know through ``fsspec``.
"""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from raylm.runner.loading.remote_files import filesystem_from_uri
from raylm.scheduler.config import envs


@dataclass(frozen=True)
class Location:
    """A file system and a path in it; ``uri`` is what the user sees (and passed)."""

    fs: Any  # pyarrow.fs.FileSystem
    path: str
    uri: str

    @property
    def is_local(self) -> bool:
        import pyarrow.fs as pafs

        return isinstance(self.fs, pafs.LocalFileSystem)

    def child(self, name: str) -> Location:
        sep = "" if self.uri.endswith("/") else "/"
        return Location(self.fs, posixpath.join(self.path, name), self.uri + sep + name)

    def sibling(self, suffix: str) -> Location:
        """``<path><suffix>`` beside this location."""
        uri = self.uri.rstrip("/")
        return Location(self.fs, self.path.rstrip("/") + suffix, uri + suffix)

    # -- queries ---------------------------------------------------------------------------
    def exists(self) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.path).type == pafs.FileType.Directory

    def list_files(self) -> list[Location]:
        """The files directly in this folder, by name; [] when it does not exist."""
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        names = sorted(posixpath.basename(i.path) for i in infos if i.type == pafs.FileType.File)
        return [self.child(n) for n in names]

    # -- reads and writes --------------------------------------------------------------------
    def read_text(self) -> str:
        with self.fs.open_input_stream(self.path) as f:
            return f.read().decode("utf-8")

    def write_text(self, text: str) -> None:
        """Readers never see a half-written file: locally it is written aside and renamed;
        an object store makes an object visible only once its upload completes."""
        parent = posixpath.dirname(self.path)
        if self.is_local:
            self.fs.create_dir(parent, recursive=True)
            tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"
            with self.fs.open_output_stream(tmp) as f:
                f.write(text.encode("utf-8"))
            self.fs.move(tmp, self.path)
            return
        with self.fs.open_output_stream(self.path) as f:
            f.write(text.encode("utf-8"))

    def delete_dir(self) -> None:
        if self.exists():
            self.fs.delete_dir(self.path)


def resolve(uri: str) -> Location:
    """The Location of a local path, a ``file://`` URI or any URI pyarrow / fsspec know."""
    if not uri:
        raise ValueError("a batch input or output location must not be empty.")
    if "://" not in uri:
        import pyarrow.fs as pafs

        path = os.path.abspath(os.path.expanduser(uri))
        return Location(pafs.LocalFileSystem(), path, path + ("/" if uri.endswith("/") else ""))
    import pyarrow.fs as pafs

    parts = urlsplit(uri)
    query = dict(parse_qsl(parts.query))
    if parts.scheme == "s3":
        # A shard (smaller than one upload part) goes up as one PutObject instead of the
        # three requests of a multipart upload.
        query.setdefault("allow_delayed_open", "true")
    arrow_uri = urlunsplit(parts._replace(query=urlencode(query)))
    try:
        fs, path = pafs.FileSystem.from_uri(arrow_uri)
    except (ValueError, NotImplementedError):  # pyarrow.ArrowInvalid: a scheme it lacks
        fs, path = filesystem_from_uri(uri)
    shown = urlunsplit(parts._replace(query=""))
    return Location(fs, path.rstrip("/") if path != "/" else path, shown)


# ---- a Ray job's working directory ---------------------------------------------------------

def job_working_dir() -> str | None:
    """The driver's working directory when it is a Ray job's uploaded ``working_dir``: Ray
    unpacks it into the session's temporary ``runtime_resources`` and deletes it with the
    session, so nothing written there reaches the submitter."""
    cwd = os.getcwd()
    job_config = envs.ray_job_config_json()
    if job_config:
        try:
            runtime_env = json.loads(job_config).get("runtime_env") or {}
        except (json.JSONDecodeError, AttributeError):
            runtime_env = {}
        if runtime_env.get("working_dir"):
            return cwd
    if f"{os.sep}runtime_resources{os.sep}" in cwd and "working_dir_files" in cwd:
        return cwd
    return None


def check_output_location(output: str) -> None:
    """Refuse an output that would land in a Ray job's temporary working directory."""
    if "://" in output:
        return
    wd = job_working_dir()
    if wd is None:
        return
    path = os.path.abspath(os.path.expanduser(output))
    if path == wd or path.startswith(wd.rstrip(os.sep) + os.sep):
        raise ValueError(
            f"--output {output!r} is inside this Ray job's working directory ({wd}), Ray's "
            "temporary copy of --working-dir that is deleted with the Ray session and that "
            "the submitter never sees. Pass an absolute path on a volume the cluster shares "
            "with you (e.g. --output /mnt/shared/out.jsonl) or an object-store URI (e.g. "
            "--output s3://bucket/out.jsonl).")

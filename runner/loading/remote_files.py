"""Files named by URI (``s3://``, ``gs://``, ``hdfs://``, any ``pyarrow.fs`` or ``fsspec``
scheme), read where they are used: a worker on any node copies them once into raylm's
cache on that node (a folder per URI), so every later load reads local files.

Credentials and endpoints come from the environment, as the cloud SDKs read them
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...). A plain path or ``file://`` URI is
used in place.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import uuid
from collections.abc import Sequence
from typing import Any

from raylm.scheduler.config import envs


def is_uri(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    """A local path for a plain path or a ``file://`` URI."""
    return path[len("file://"):] if path.startswith("file://") else path


def filesystem_from_uri(uri: str) -> tuple[Any, str]:
    """(pyarrow FileSystem, path in it) for ``uri``: pyarrow's own schemes, then any that
    fsspec knows (ValueError naming the URI otherwise)."""
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, NotImplementedError):  # pyarrow.ArrowInvalid: a scheme it lacks
        pass
    try:
        import fsspec
    except ImportError as e:
        raise ValueError(f"{uri!r}: pyarrow does not know this scheme and fsspec is not "
                         "installed.") from e
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ValueError, ImportError) as e:
        raise ValueError(f"{uri!r}: neither pyarrow nor fsspec can open it: {e}") from e
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def exists(path: str) -> bool:
    """Whether the file or folder at a path or URI exists (False if it cannot be read)."""
    if not is_uri(path):
        return os.path.exists(local_path(path))
    import pyarrow.fs as pafs

    try:
        fs, where = filesystem_from_uri(path)
        return fs.get_file_info(where).type != pafs.FileType.NotFound
    except (OSError, ValueError):
        return False


def fetch_folder(uri: str, names: Sequence[str], kind: str) -> str:
    """A local folder holding ``names`` of the folder at ``uri``: the path itself when it is
    local, else raylm's cache copy on this node (``<cache>/<kind>/<hash of the URI>``),
    made once; a copy in progress elsewhere is never seen half-written (it is renamed
    into place). ValueError naming the URI and the file that cannot be read."""
    if not is_uri(uri):
        return local_path(uri)
    dest = os.path.join(envs.cache_dir(), kind,
                        hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:24])
    if all(os.path.isfile(os.path.join(dest, n)) for n in names):
        return dest
    fs, base = filesystem_from_uri(uri.rstrip("/"))
    tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        for name in names:
            try:
                with fs.open_input_stream(posixpath.join(base, name)) as src, \
                        open(os.path.join(tmp, name), "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
            except OSError as e:
                raise ValueError(f"{uri!r}: cannot read {name}: {e}") from None
        try:
            os.rename(tmp, dest)
        except OSError:  # another process put it there first
            if not all(os.path.isfile(os.path.join(dest, n)) for n in names):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest

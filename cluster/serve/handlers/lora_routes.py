"""LoRA adapters as models of one served model (vLLM's shapes).

Each adapter is a model of its own: requests name it in ``model`` (``adapter`` or
``base:adapter``, Ray Serve LLM's form), ``/v1/models`` lists it with its ``parent``, the
base model. Adapters come from ``lora_modules`` (``name=path``) at start, and at run time
from ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and
``/v1/unload_lora_adapter`` (``{"lora_name"}``): off unless the server was started with
``allowed_lora_root``, and then only from folders under that root (the client names the
path). With a root, a request naming an adapter not loaded yet loads ``root/<name>`` when
that is a PEFT folder (Ray Serve LLM's ``dynamic_lora_loading_path``, vLLM's filesystem
resolver): every replica can serve every adapter of the root, and the prefix router keeps
an adapter's requests on the replica that loaded it (cluster/serve/deployment/router.py). Each load gets an id of its own, so a name loaded again after an unload never
meets the old weights in an engine cache. An unknown adapter is a 404; a path outside
the root, an adapter the engine cannot run, a name loaded twice are 400s.

One replica's view: a POST load reaches the replica that handled it; loading by name
from the root is what makes an adapter available on every replica.
"""

from __future__ import annotations

import itertools
import os
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any

from raylm.cluster.serve.openai_api.errors import bad_request, not_found
from raylm.cluster.serve.openai_api.protocol import OpenAIBaseModel
from raylm.cluster.serve.openai_api.response_protocol import ModelCard
from raylm.runner.loading import remote_files
from raylm.runner.lora.peft import CONFIG_FILE
from raylm.scheduler.lora import LoRARequest
from raylm.scheduler.request import InvalidRequestError

LOAD_LORA = "/v1/load_lora_adapter"
UNLOAD_LORA = "/v1/unload_lora_adapter"
# The key of a model card that carries its adapters' cards (the routes list them apart).
ADAPTERS_KEY = "lora_adapters"


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModules:
    """The adapters of the model ``base_name``. ``check`` refuses an adapter the engine
    cannot run (the intake's ``check_lora``: InvalidRequestError)."""

    def __init__(self, base_name: str, check: Callable[[LoRARequest], None],
                 modules: Mapping[str, str] | None = None,
                 allowed_root: str | None = None) -> None:
        self.base_name = base_name
        self._check = check
        self.allowed_root = _normalized_root(allowed_root) if allowed_root else None
        if self.allowed_root is not None and not (
                remote_files.exists(self.allowed_root) if remote_files.is_uri(self.allowed_root)
                else os.path.isdir(self.allowed_root)):
            raise ValueError(f"allowed_lora_root {allowed_root!r} is not a folder on this node "
                             "nor a URI that can be read from here.")
        self.adapters: dict[str, LoRARequest] = {}
        self._created: dict[str, int] = {}
        self._ids = itertools.count(1)
        for name, path in (modules or {}).items():
            self._add(name, path)  # a bad module fails the start, naming it

    @classmethod
    def from_engine_kwargs(cls, engine_kwargs: Any, base_name: str,
                           engine: Any) -> LoRAModules | None:
        """The adapters that engine arguments (``lora_modules``, ``allowed_lora_root``)
        ask of ``engine`` (an EngineClient, its intake checks each); None without LoRA."""
        if not getattr(engine_kwargs, "enable_lora", False):
            for name in ("lora_modules", "allowed_lora_root"):
                if getattr(engine_kwargs, name, None):
                    raise ValueError(f"{name} needs enable_lora=True.")
            return None
        from raylm.cluster.engine.engine_args import EngineArgs

        modules = EngineArgs(model="", lora_modules=engine_kwargs.lora_modules,
                             enable_lora=True).lora_module_paths()
        return cls(base_name, engine.input_processor.check_lora, modules,
                   engine_kwargs.allowed_lora_root)

    # ---- requests ---------------------------------------------------------------------
    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model); 404 for any other name."""
        if model is None or model == self.base_name:
            return None
        base, sep, name = model.partition(":")
        if not sep:
            base, name = self.base_name, model
        adapter = self.adapters.get(name) if base == self.base_name else None
        if adapter is None and base == self.base_name:
            adapter = self._load_by_name(name)
        if adapter is None:
            raise not_found(f"The model `{model}` does not exist: this server serves "
                            f"{self.base_name!r} and its LoRA adapters "
                            f"{sorted(self.adapters)}.", "model")
        return adapter

    def cards(self) -> list[dict[str, Any]]:
        return [ModelCard(id=name, root=lora.lora_path, parent=self.base_name,
                          created=self._created[name]).model_dump()
                for name, lora in self.adapters.items()]

    # ---- run-time loading ---------------------------------------------------------------
    def check_runtime_loading(self) -> None:
        if self.allowed_root is None:
            raise bad_request("loading LoRA adapters at run time is off on this server (start "
                              "it with allowed_lora_root, a folder of adapters).", "lora_path")

    def handle(self, request: LoadLoRAAdapterRequest | UnloadLoRAAdapterRequest
               ) -> dict[str, Any]:
        """POST /v1/load_lora_adapter or /v1/unload_lora_adapter, the body parsed."""
        self.check_runtime_loading()
        if isinstance(request, LoadLoRAAdapterRequest):
            if request.lora_name in self.adapters:
                raise bad_request(f"The lora adapter '{request.lora_name}' has already been "
                                  "loaded.", "lora_name")
            self._add(request.lora_name, self._under_root(request.lora_path))
            return {"object": "lora_adapter", "lora_name": request.lora_name,
                    "message": f"Success: LoRA adapter '{request.lora_name}' added "
                               "successfully."}
        if self.adapters.pop(request.lora_name, None) is None:
            raise not_found(f"The lora adapter '{request.lora_name}' cannot be found.",
                            "lora_name")
        self._created.pop(request.lora_name, None)
        return {"object": "lora_adapter", "lora_name": request.lora_name,
                "message": f"Success: LoRA adapter '{request.lora_name}' removed "
                           "successfully."}

    def _load_by_name(self, name: str) -> LoRARequest | None:
        """``root/<name>`` as adapter ``name`` when the root holds such a PEFT folder."""
        if self.allowed_root is None or not name or name.startswith(".") or "/" in name \
                or os.sep in name:
            return None
        path = self._under_root(name)
        if not remote_files.exists(posixpath.join(path, CONFIG_FILE) if remote_files.is_uri(path)
                                   else os.path.join(path, CONFIG_FILE)):
            return None
        self._add(name, path)
        return self.adapters[name]

    def _under_root(self, path: str) -> str:
        """``path`` (absolute, or relative to the root) with links and ``..`` resolved; 400
        unless it is inside the root. A URI root takes URIs under it and relative paths."""
        assert self.allowed_root is not None
        if remote_files.is_uri(self.allowed_root):
            scheme, _, rest = self.allowed_root.partition("://")
            if remote_files.is_uri(path):  # a URI: of the root's scheme, under it
                other, _, where = path.partition("://")
                where = where if other == scheme else ""
            else:  # a name or path relative to the root
                where = "" if path.startswith("/") else posixpath.join(rest, path)
            inside = posixpath.normpath(where) if where else ""
            if not inside or not (inside + "/").startswith(rest + "/"):
                raise bad_request(f"lora_path {path!r} is outside {self.allowed_root!r}, "
                                  "where this server loads adapters from.", "lora_path")
            return f"{scheme}://{inside}"
        real = os.path.realpath(os.path.join(self.allowed_root, path))
        if os.path.commonpath([real, self.allowed_root]) != self.allowed_root:
            raise bad_request(f"lora_path {path!r} is outside the folder this server loads "
                              "adapters from.", "lora_path")
        return real

    def _add(self, name: str, path: str) -> None:
        if not name or ":" in name or name == self.base_name:
            raise bad_request(f"lora_name {name!r} must be non-empty, without ':', and not the "
                              "base model's name.", "lora_name")
        lora = LoRARequest(name, next(self._ids), path, base_model_name=self.base_name)
        try:
            self._check(lora)
        except InvalidRequestError as e:
            raise bad_request(str(e), "lora_path") from None
        self.adapters[name] = lora
        self._created[name] = int(time.time())



def _normalized_root(root: str) -> str:
    """A local root with links resolved, or a URI without its trailing slash."""
    if remote_files.is_uri(root):
        scheme, _, rest = root.partition("://")
        return f"{scheme}://{posixpath.normpath(rest)}"
    return os.path.realpath(remote_files.local_path(root))

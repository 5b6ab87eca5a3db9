"""A model's own state-dict hooks: the names it saves under, kept apart from the names
meshfit's checkpoints use.

Some models rename their tensors in `state_dict()` through hooks on their modules (a
fused q|k|v projection saved as separate wq / wk / wv, as converters for torchtitan's
models do), and fuse them back in `load_state_dict()`. torch.distributed.checkpoint's
`get_state_dict` / `set_state_dict` walk the module tree by the names `state_dict()`
gives, so such a model could not be checkpointed at all ("'Attention' object has no
attribute 'wq'").

meshfit keeps two name spaces:
- checkpoints (`engine.save` / `load`, `weights=` of a checkpoint, `meshfit export`,
  which has no model code to run) hold the tensors as the modules hold them: the user's
  hooks are set aside while they are read or written (`set_aside`);
- what the user gets as the model's state (`engine.full_state_dict`,
  `engine.save_model`) goes through the model's own post-hooks (`run_saving_hooks`), as
  `model.state_dict()` would; `weights=` of safetensors goes through its load hooks.

Only the hooks the model had when it was handed to meshfit count as its own (captured by
`OwnHooks.of` before any form is applied): the forms' own hooks (FSDP2's, DDP's) stay.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

# The hook tables of an nn.Module that act on state dicts.
_SAVE = ("_state_dict_pre_hooks", "_state_dict_hooks")
_LOAD = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


@dataclass
class OwnHooks:
    """The user's state-dict hooks: {module name: (the module, {table: hook ids})}."""

    modules: dict[str, tuple[nn.Module, dict[str, list[int]]]]

    @classmethod
    def of(cls, model: nn.Module) -> OwnHooks:
        found = {}
        for name, module in model.named_modules():
            tables = {t: list(getattr(module, t)) for t in (*_SAVE, *_LOAD) if getattr(module, t)}
            if tables:
                found[name] = (module, tables)
        return cls(found)

    def __bool__(self) -> bool:
        return bool(self.modules)

    @property
    def loading(self) -> list[str]:
        """Modules whose own hooks change what load_state_dict takes."""
        return [n for n, (_, tables) in self.modules.items() if any(t in tables for t in _LOAD)]

    @property
    def saving(self) -> dict[str, nn.Module]:
        """{module name: module} of those whose own post-hooks change what
        state_dict gives."""
        return {n: m for n, (m, tables) in self.modules.items() if "_state_dict_hooks" in tables}

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """While inside: the modules' own hooks are not run (the forms' still are)."""
        removed: list[tuple[Any, int, Any]] = []
        for module, tables in self.modules.values():
            for table, ids in tables.items():
                hooks = getattr(module, table)
                for hook_id in ids:
                    if hook_id in hooks:
                        removed.append((hooks, hook_id, hooks.pop(hook_id)))
        try:
            yield
        finally:
            for hooks, hook_id, hook in removed:
                hooks[hook_id] = hook

    def unit_of(self, key: str) -> str | None:
        """The outermost module with saving hooks that holds `key` ("" for the model
        itself, None for none): its tensors must reach run_saving_hooks together."""
        for name in sorted(self.saving, key=len):
            if name == "" or key.startswith(name + "."):
                return name
        return None

    def run_saving_hooks(self, state: dict[str, Any], units: list[str] | None = None) -> dict:
        """`state` (the tensors under the modules' own names) as `model.state_dict()`
        would give it: each module's own post-hooks run on it, children before parents,
        as Module.state_dict runs them. `units`: only the hooks of these modules and the
        modules inside them (those whose tensors `state` holds whole)."""
        destination: Any = OrderedDict(state)
        chosen = {
            n: m
            for n, m in self.saving.items()
            if units is None or any(u == "" or n == u or n.startswith(u + ".") for u in units)
        }
        # deeper modules first: state_dict runs a module's hooks after its children's
        for name in sorted(chosen, key=lambda n: -n.count(".") - (n != "")):
            module = chosen[name]
            prefix = f"{name}." if name else ""
            for hook_id in self.modules[name][1]["_state_dict_hooks"]:
                hook = module._state_dict_hooks.get(hook_id)
                if hook is None:
                    continue
                result = hook(module, destination, prefix, {"version": module._version})
                if result is not None and not getattr(hook, "_from_public_api", False):
                    destination = result
        return dict(destination)

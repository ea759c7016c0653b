"""The user's own code told from torch's and smp's, and an exception it raised said in one line."""

from __future__ import annotations

import linecache
import sysconfig
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["is_user_file", "raised_by_user_code", "user_code_message"]

# Code that is not the user's: torch and the Python standard library, and smp's own packages.
_LIBRARY_DIRS = tuple(str(d) + "/" for d in (Path(torch.__file__).resolve().parent,
                                             Path(sysconfig.get_paths()["stdlib"]).resolve()))
_SMP_DIRS = tuple(str(Path(__file__).resolve().parent.parent / pkg) + "/" for pkg in ("partitioner", "smp", "runtime"))


def is_user_file(filename: str) -> bool:
    # "<frozen importlib._bootstrap>", "<string>": no file to point at.
    return not filename.startswith("<") and not str(Path(filename).resolve()).startswith(_LIBRARY_DIRS + _SMP_DIRS)


def raised_by_user_code(err: BaseException) -> bool:
    """Whether the deepest frame of ``err`` outside torch and the standard library is the user's, not smp's."""
    frames = [f.f_code.co_filename for f, _ in traceback.walk_tb(err.__traceback__)]
    own = [f for f in frames if not f.startswith("<") and not str(Path(f).resolve()).startswith(_LIBRARY_DIRS)]
    return bool(own) and is_user_file(own[-1])


def _shape(value: Any) -> str:
    return "x".join(map(str, value.shape)) if value.dim() else "scalar"


def _tensor_shapes(named: Mapping[str, Any]) -> list[str]:
    """``name (shape)`` for every tensor in ``named`` (nested containers by path)."""
    out = []
    for name, value in named.items():
        leaves, _ = pytree.tree_flatten_with_path(value)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                out.append(f"{name}{pytree.keystr(path)} {_shape(leaf)}")
    return out


def user_code_message(err: BaseException, what: str, *, model: nn.Module | None = None,
                      inputs: Mapping[str, Any] | None = None, file: str | None = None) -> str:
    """One line for an exception raised by the user's code: what raised, the message, where, which shapes.

    ``what`` starts the sentence ("Net raised", "factory 'make' in my.py raised"). The place is
    the deepest frame in ``file`` when given, else the deepest frame outside torch, the
    standard library and smp; with a ``model``, the deepest of its modules on the stack is
    named with the shapes of the tensors its ``forward`` was given; ``inputs`` are listed
    with their shapes.
    """
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    text = f"{what} {type(err).__name__}" + (f": {lines[0][:500].rstrip('.')}" if lines else "")
    module_names = {id(m): name for name, m in model.named_modules()} if model is not None else {}
    module_at: tuple[str, nn.Module, list[str]] | None = None
    place: tuple[str, int, str] | None = None
    frames = list(traceback.walk_tb(err.__traceback__))
    if isinstance(err, SyntaxError) and err.filename:
        place = (err.filename, err.lineno or 0, "<module>")
    for frame, lineno in frames:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in module_names and frame.f_code.co_name == "forward":
            code = frame.f_code
            arg_names = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
            given = _tensor_shapes({n: frame.f_locals[n] for n in arg_names if n in frame.f_locals})
            module_at = (module_names[id(owner)], owner, given)
        filename = frame.f_code.co_filename
        if (Path(filename).resolve() == Path(file).resolve()) if file else is_user_file(filename):
            place = (filename, lineno, frame.f_code.co_name)
    if module_at is not None and module_at[0]:
        path, module, given = module_at
        desc = repr(module) if "\n" not in repr(module) else type(module).__name__
        text += f"; in module '{path}' = {desc}" + (f" given {', '.join(given)}" if given else "")
    if place is not None:
        filename, lineno, func = place
        linecache.checkcache(filename)  # the file may have changed since it was last read
        code_line = linecache.getline(filename, lineno).strip() if lineno else ""
        text += f"; at {filename}:{lineno} in {func}" + (f": `{code_line}`" if code_line else "")
    if inputs:
        shapes = _tensor_shapes(inputs)
        if shapes:
            text += f"; sample inputs: {', '.join(shapes)}"
    return text

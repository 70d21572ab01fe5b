"""The custom ops of trainbox's kernels and their compiler fallbacks, registered in one place.

Each kernel module defines its ops with `torch.library.custom_op` in the `trainbox` namespace (the ops exist
once the module is imported). Inductor gets them as explicit fallbacks here: left to its implicit fallback,
torch < 2.13 logs each call with its inputs' IR rendered as text, eagerly, and through a chain of these ops
(each made from the previous one's outputs) that text doubles per layer, so compiling gpt2-125m would not
finish. Inductor keeps the graph's strides for them (`constrain_to_fx_strides`), as for an implicit fallback.
"""
from __future__ import annotations

import functools
import getpass
import os
import sys
import tempfile

import torch

# why an optional kernel package did not load, by distribution (flash-attn-4, quack-kernels): its loader
# (kernels/flash.py _interface, kernels/fused_mlp.py _quack) writes it, doctor reports it
LOAD_ERRORS: dict[str, str] = {}


def load_failed(dist_name: str, e: BaseException) -> str:
    """Record why `dist_name` did not load (the exception's type and first line) -> that reason."""
    first = str(e).splitlines()[0][:200] if str(e) else ""
    LOAD_ERRORS[dist_name] = f"{type(e).__name__}: {first}"
    return LOAD_ERRORS[dist_name]


def autocast_dtype(device_type: str, default: torch.dtype | None) -> torch.dtype | None:
    """The dtype matmuls run in under autocast on `device_type`, else `default`."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else default


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's gelu ("gelu_new" in Hugging Face): the tanh approximation."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def eager(fn):
    """`torch.compiler.disable(fn)`, applied when `fn` is first called with Dynamo loaded: `fn` runs eagerly, a
    graph break where a compiled function calls it. The decorator itself imports torch._dynamo (with sympy and
    FSDP, most of a second), which a process that builds no optimizer never otherwise loads: until something loads
    Dynamo no frame can be compiled, and `fn` runs as it is. The wrapper carries the mark that keeps Dynamo from
    tracing into a disabled function, so the graphs on either side of the call are torch's (tests/test_startup.py);
    called from compiled code, the wrapper's own frame is offered to Dynamo, which finds nothing in it to compile."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True
    return call


def constant_when_traced(fn):
    """`torch.compiler.assume_constant_result(fn)` without importing torch._dynamo (see `eager`): the mark that
    decorator sets, which Dynamo reads when it traces a call of `fn` (tests/test_startup.py holds the two equal)."""
    fn._dynamo_marked_constant = True
    return fn


def compile_cache_dir() -> str:
    """Inductor's default cache folder (moved between torch releases; the fallback is its documented default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # optional: a feature this torch may lack
    except ImportError:
        try:
            from torch._inductor.runtime.runtime_utils import cache_dir  # optional: a feature this torch may lack
        except ImportError:
            return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return cache_dir()


def inductor_fallback(*ops) -> None:
    """Register `ops` (OpOverloads) with Inductor as explicit fallbacks, keeping the graph's strides."""
    try:
        from torch._inductor import lowering  # optional: a feature this torch may lack
    except ImportError:  # pragma: no cover - a torch without Inductor compiles nothing
        return
    layout = getattr(lowering, "constrain_to_fx_strides", None)
    for op in ops:
        if op not in lowering.lowerings:
            lowering.make_fallback(op, layout_constraint=layout, warn=False)

"""The operators torch refuses to run on CUDA in deterministic mode, in one place (docs/scaling.md,
"The GPU path: syncs, copies and the memory model").

The replay runs under ``torch.use_deterministic_algorithms(True)`` (docs/glossary.md, "Replay"). On CUDA, torch
then raises a RuntimeError on every operator that has only a non-deterministic kernel there —
float ``cumsum`` among them — so a replay that dispatches one would stop on a GPU, never on the
CPU. ``CUDA_RAISING`` is that list, operator by operator, and ``raising_on_cuda`` judges a
dispatched call against it; tests/test_determinism.py records every operator each family's
replay dispatches on the CPU (forward, backward, pair receipts, generation) and fails on any.

Source: the docstring of ``torch.use_deterministic_algorithms`` (torch 2.13, "The following
normally-nondeterministic operations will throw a RuntimeError when mode=True"), each entry
mapped to the ATen operators that implement it. Every entry there is CUDA-only except
``MaxUnpool*``, ``put_`` without accumulate and ``resize_`` of a quantized tensor, which raise
everywhere. The other list of that docstring (operators that switch to a deterministic
kernel) needs nothing from us. Re-read it when torch is upgraded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

Condition = Callable[[Callable[[str], Any]], bool]  # given the call's argument by schema name


def _always(arg: Callable[[str], Any]) -> bool:
    return True


def _float_cumsum(arg: Callable[[str], Any]) -> bool:
    dtype = arg("dtype") or arg("self").dtype
    return bool(dtype.is_floating_point or dtype.is_complex)


def _weights_given(arg: Callable[[str], Any]) -> bool:
    return arg("weights") is not None


def _reduce_prod(arg: Callable[[str], Any]) -> bool:
    return bool(arg("reduce") == "prod")


def _quantized(arg: Callable[[str], Any]) -> bool:
    return bool(arg("self").is_quantized)


def _bag_max(arg: Callable[[str], Any]) -> bool:
    return bool(arg("mode") == 2)  # EmbeddingBag's MODE_MAX


@dataclass(frozen=True)
class Raising:
    """One entry of torch's list: what the docs say, and when the operator call matches it."""

    documented: str
    when: Condition = _always


_DIFFERENTIATE = "when attempting to differentiate a CUDA tensor"
# ATen operator (overload packet name) → the documented entry it implements
CUDA_RAISING: dict[str, Raising] = {
    "avg_pool3d_backward": Raising(f"torch.nn.AvgPool3d {_DIFFERENTIATE}"),
    "_adaptive_avg_pool2d_backward": Raising(f"torch.nn.AdaptiveAvgPool2d {_DIFFERENTIATE}"),
    "_adaptive_avg_pool3d_backward": Raising(f"torch.nn.AdaptiveAvgPool3d {_DIFFERENTIATE}"),
    "adaptive_max_pool2d_backward": Raising(f"torch.nn.AdaptiveMaxPool2d {_DIFFERENTIATE}"),
    "fractional_max_pool2d_backward": Raising(f"torch.nn.FractionalMaxPool2d {_DIFFERENTIATE}"),
    "fractional_max_pool3d_backward": Raising(f"torch.nn.FractionalMaxPool3d {_DIFFERENTIATE}"),
    "max_unpool2d": Raising("torch.nn.MaxUnpool1d / MaxUnpool2d"),
    "max_unpool3d": Raising("torch.nn.MaxUnpool3d"),
    **{
        op: Raising(f"torch.nn.functional.interpolate {_DIFFERENTIATE} (linear, bilinear, bicubic, trilinear)")
        for op in (
            "upsample_linear1d_backward",
            "upsample_bilinear2d_backward",
            "upsample_bicubic2d_backward",
            "upsample_trilinear3d_backward",
            "_upsample_bilinear2d_aa_backward",
            "_upsample_bicubic2d_aa_backward",
        )
    },
    **{f"reflection_pad{d}d_backward": Raising(f"torch.nn.ReflectionPad{d}d {_DIFFERENTIATE}") for d in (1, 2, 3)},
    "nll_loss_forward": Raising("torch.nn.NLLLoss when called on a CUDA tensor (F.cross_entropy too)"),
    "nll_loss2d_forward": Raising("torch.nn.NLLLoss when called on a CUDA tensor"),
    "_ctc_loss_backward": Raising(f"torch.nn.CTCLoss {_DIFFERENTIATE}"),
    "_embedding_bag_backward": Raising(f"torch.nn.EmbeddingBag {_DIFFERENTIATE} when mode='max'", _bag_max),
    "_embedding_bag_dense_backward": Raising(f"torch.nn.EmbeddingBag {_DIFFERENTIATE} when mode='max'", _bag_max),
    "put_": Raising("torch.Tensor.put_ (accumulate=False anywhere, accumulate=True on a CUDA tensor)"),
    "put": Raising("torch.Tensor.put_ (accumulate=False anywhere, accumulate=True on a CUDA tensor)"),
    "histc": Raising("torch.histc when called on a CUDA tensor"),
    "bincount": Raising("torch.bincount when called on a CUDA tensor and weights tensor is given", _weights_given),
    "median": Raising("torch.median with indices output when called on a CUDA tensor"),  # .dim overloads only
    "grid_sampler_2d_backward": Raising(f"torch.nn.functional.grid_sample {_DIFFERENTIATE}"),
    "grid_sampler_3d_backward": Raising(f"torch.nn.functional.grid_sample {_DIFFERENTIATE}"),
    "cumsum": Raising(
        "torch.cumsum when called on a CUDA tensor when dtype is floating point or complex", _float_cumsum
    ),
    "cumsum_": Raising(
        "torch.cumsum when called on a CUDA tensor when dtype is floating point or complex", _float_cumsum
    ),
    "scatter_reduce": Raising("torch.Tensor.scatter_reduce when reduce='prod' and called on CUDA tensor", _reduce_prod),
    "scatter_reduce_": Raising(
        "torch.Tensor.scatter_reduce when reduce='prod' and called on CUDA tensor", _reduce_prod
    ),
    "resize_": Raising("torch.Tensor.resize_ when called with a quantized tensor", _quantized),
}
_MEDIAN_WITH_INDICES = {"dim", "dim_values", "names_dim", "names_dim_values"}


def raising_on_cuda(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The documented entry an ATen call ``func(*args, **kwargs)`` falls under, or None."""
    name = func.overloadpacket.__name__
    entry = CUDA_RAISING.get(name)
    if entry is None or (name == "median" and func._overloadname not in _MEDIAN_WITH_INDICES):
        return None
    names = [a.name for a in func._schema.arguments]

    def arg(key: str) -> Any:
        if key in kwargs:
            return kwargs[key]
        i = names.index(key)
        return args[i] if i < len(args) else None  # absent: its default, None for these

    return entry.documented if entry.when(arg) else None


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()
        self.raising: dict[str, str] = {}  # "aten.cumsum.default" → the documented entry

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self.ops.add(str(func))
        why = raising_on_cuda(func, args, kwargs)
        if why is not None:
            self.raising[str(func)] = why
        return func(*args, **kwargs)


@contextmanager
def recording() -> Iterator[_Recorder]:
    """Record every ATen operator dispatched in the block (autograd's backward included: on the
    CPU it runs on the calling thread) and those of them ``CUDA_RAISING`` lists."""
    with _Recorder() as recorder:
        yield recorder


__all__ = ["CUDA_RAISING", "Raising", "raising_on_cuda", "recording"]

"""Every rank of a layout runs the same generation.

- `agree_on_arguments`: every pipeline call first checks that all ranks were called with the same
  settings (steps, sizes, prompts, guidance, …) and stops every rank with one message if not;
- `agree_on_noise`: every rank starts from the same noise: rank 0's generator state and initial
  latents win. Parallel output can only equal single-process output if all ranks denoise the same
  latents; a user's script may seed ranks differently, or not at all.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from accel.errors import UserError
from accel.hooks import CALL, NOISE, wrap, wrap_call
from accel.parallel.comm import global_rank
from accel.parallel.outputs import tensors_of

# pipe.__call__: outermost of everything accel installs, so the check runs before any collective of
# the call. (Belongs beside the other layers in accel.hooks once another entry wraps __call__.)


def agree_on_noise(pipe: Any, group: dist.ProcessGroup | None = None) -> Callable[[], None]:
    """Wrap this pipeline's `prepare_latents` so all ranks of `group` (None: the job) share its first
    rank's randomness (the call's generators and the global random state); returns the undo."""
    signature = inspect.signature(pipe.prepare_latents)

    def prepare_latents(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        generators = list(_generators(bound.arguments.get("generator")))
        states, global_state = rank0_object(([g.get_state() for g in generators], _global_rng_state()), group)
        for generator, state in zip(generators, states):
            generator.set_state(state)
        _set_global_rng_state(global_state)  # a step callback or scheduler may draw from it later
        result = call_next(*args, **kwargs)
        for tensor in tensors_of(result):
            dist.broadcast(tensor, src=global_rank(group, 0), group=group)
        return result

    return wrap(pipe, "prepare_latents", "accel.agree_on_noise", NOISE, prepare_latents)


def rank0_object(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's `value` (any picklable object, e.g. a random state), on every rank of `group`."""
    box = [value]
    dist.broadcast_object_list(box, src=global_rank(group, 0), group=group)
    return box[0]


def every_rank_object(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value` (picklable), in rank order, on every rank of `group`."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _global_rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The global CPU random state and, once CUDA is in use, the current device's."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_global_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _generators(value: Any) -> Iterable[torch.Generator]:
    if isinstance(value, torch.Generator):
        return [value]
    if isinstance(value, (list, tuple)):
        return [g for g in value if isinstance(g, torch.Generator)]
    return []


# -- the same arguments on every rank ------------------------------------------------------------------

_STRING_KEPT = 64  # longer strings (prompts) are compared by a digest, not sent whole
_SHOWN = 40  # characters of one value in the message


def agree_on_arguments(
    pipe: Any, group: dist.ProcessGroup | None = None, may_differ: Iterable[str] = ()
) -> Callable[[], None]:
    """Check, at the start of every call of this pipeline, that all ranks of `group` (None: the job)
    were called with the same arguments; raise one `UserError` on every rank naming each setting that
    differs and its value per rank. Returns the undo.

    One `all_gather_object` per call, before any other collective of the call, so no rank waits in a
    collective the others never reach. Arguments are bound to the pipeline's `__call__` signature with
    defaults applied (positional, keyword and default spellings of one value agree). Tensors and
    arrays (`latents`, `prompt_embeds`, …) are compared by shape, dtype and device type, never by
    contents (no device-to-host copy), long strings by a digest, other objects by type.

    Not compared: `generator` and `callback*`. Ranks may be seeded differently on purpose (or not at
    all): `agree_on_noise` makes rank 0's randomness and initial latents win on every rank. The
    global random state is rank 0's from the start of the call already: a pipeline may draw from it
    before its latents (SD 3.5's ControlNet pipelines sample the control picture's latents from it),
    and ranks that drew different ones would split different residuals.

    `may_differ`: arguments left out of the check, only where the caller makes a difference harmless:
    [memory] vae = "rank0" passes ("output_type",), since the ranks that do not decode ask for latents
    whatever they were given. Never by default: with the decode split over the ranks ([vae] parallel)
    a rank asking for latents would skip the decode's collectives and the others would wait for it."""
    signature = inspect.signature(pipe.__call__)
    free = frozenset(may_differ)

    def check(call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        _set_global_rng_state(check_same_arguments(signature, args, kwargs, group, free))
        return call_next(*args, **kwargs)

    return wrap_call(pipe, "accel.agree_on_arguments", CALL, check)


def check_same_arguments(
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    may_differ: frozenset[str] = frozenset(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raise on every rank of `group` unless all were called with the same `args` / `kwargs` (but the
    names in `may_differ`); else return rank 0's global random state, which travels in the same
    exchange (no second collective)."""
    failure: BaseException | None = None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:  # reported to the other ranks too, or they would wait for this one
        failure, mine = error, ("error", f"{type(error).__name__}: {error}")
    else:
        bound.apply_defaults()
        mine = (
            "arguments",
            {
                name: summary
                for name, summary in _summaries(signature, bound.arguments).items()
                if name not in may_differ
            },
        )
    gathered: list[Any] = [None] * dist.get_world_size(group)
    state = _global_rng_state() if dist.get_rank(group) == 0 else None
    dist.all_gather_object(gathered, (dist.get_rank(), mine, state), group=group)
    ranks = sorted(gathered, key=lambda entry: entry[0])
    rank0_state = next(entry[2] for entry in gathered if entry[2] is not None)
    if failure is not None:
        raise failure
    failed = [(rank, text) for rank, (kind, text), _ in ranks if kind == "error"]
    if failed:
        rank, text = failed[0]
        raise UserError(
            f"rank {rank} could not call the pipeline ({text}); call the pipeline with the same arguments on every rank"
        )
    differing = _differences([(rank, summary) for rank, (_, summary), _ in ranks])
    if differing:
        raise UserError(
            f"ranks were called with different {_and(differing)}; call the pipeline with the same arguments on every "
            "rank"
        )
    return rank0_state


def _summaries(signature: inspect.Signature, arguments: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """(key compared across ranks, text shown) per argument; `**kwargs` spread into their names."""
    out: dict[str, tuple[Any, str]] = {}
    for name, value in arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update((str(k), _describe(v)) for k, v in value.items() if not _skipped(str(k)))
        elif not _skipped(name):
            out[name] = _describe(value)
    return out


def _skipped(name: str) -> bool:
    return name == "generator" or name.startswith("callback")


def _describe(value: Any) -> tuple[Any, str]:
    """A small picklable key equal on ranks with equal settings, and a short text for the message."""
    if value is None or isinstance(value, (bool, int)):
        return (type(value).__name__ if isinstance(value, bool) else "value", value), repr(value)
    if isinstance(value, float):
        return ("value", "nan" if value != value else value), repr(value)
    if isinstance(value, str):
        key = value if len(value) <= _STRING_KEPT else hashlib.sha256(value.encode()).hexdigest()
        return ("str", key), _short(repr(value))
    if isinstance(value, torch.Tensor):
        shape, kind = tuple(value.shape), value.device.type
        return (
            "tensor",
            shape,
            str(value.dtype),
            kind,
        ), f"tensor {_shape(shape)} {str(value.dtype).removeprefix('torch.')} on {kind}"
    if isinstance(value, torch.Generator):
        return ("generator",), "generator"
    if type(value).__module__ == "numpy" and hasattr(value, "shape") and hasattr(value, "dtype"):
        return ("array", tuple(value.shape), str(value.dtype)), f"array {_shape(tuple(value.shape))} {value.dtype}"
    if type(value).__module__.startswith("PIL.") and hasattr(value, "size") and hasattr(value, "mode"):
        return ("image", tuple(value.size), value.mode), f"image {_shape(tuple(value.size))} {value.mode}"
    if isinstance(value, (list, tuple)):
        parts = [_describe(item) for item in value]
        return ("seq", tuple(key for key, _ in parts)), _short("[" + ", ".join(text for _, text in parts) + "]")
    if isinstance(value, Mapping):
        items = [(str(k), _describe(v)) for k, v in value.items()]
        key = ("map", tuple(sorted((k, part[0]) for k, part in items)))
        return key, _short("{" + ", ".join(f"{k!r}: {part[1]}" for k, part in items) + "}")
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    return ("object", name), type(value).__name__


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"


def _differences(ranks: list[tuple[int, dict[str, tuple[Any, str]]]]) -> list[str]:
    """`name (rank 0: 4, rank 1: 2)` for each argument whose key is not the same on every rank."""
    names = list(dict.fromkeys(name for _, summary in ranks for name in summary))
    missing = ("missing",), "(not an argument)"
    out = []
    for name in names:
        values = [(rank, summary.get(name, missing)) for rank, summary in ranks]
        groups: dict[Any, tuple[str, list[int]]] = {}
        for rank, (key, text) in values:
            groups.setdefault(key, (text, []))[1].append(rank)
        if len(groups) > 1:
            out.append(f"{name} (" + ", ".join(f"{_ranks(members)}: {text}" for text, members in groups.values()) + ")")
    return out


def _ranks(members: list[int]) -> str:
    """`rank 3`, `ranks 0, 2`, `ranks 0-4, 6, 7` (runs of three or more as a range)."""
    if len(members) == 1:
        return f"rank {members[0]}"
    runs: list[list[int]] = []
    for rank in members:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return "ranks " + ", ".join(parts)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]

"""`load_pipeline`: registry alias, tiny alias, hub repo id or local folder → a ready pipeline."""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from accel.errors import ModelError, UserError
from accel.models.base import Family
from accel.models.folder_check import check_folder, read_index
from accel.models.lora import fuse_loras, parse_loras
from accel.models.refs import ModelRef, resolve_model
from accel.models.registry import family_of
from accel.models.variants import component_folders, variant_of, variant_of_class

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype | None, ref: ModelRef) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if ref.tiny:
            return torch.float32  # tiny variants exist for CPU tests, where float32 is exact and fast
        return DTYPES[ref.family.dtype] if ref.family else torch.bfloat16
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of auto, {', '.join(DTYPES)}, got '{dtype}'")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to load onto. Under torchrun (LOCAL_RANK set) "cuda" means this rank's own GPU,
    so ranks of one node do not all land on cuda:0."""
    from accel.launch.environment import rank_device

    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu or auto")
    if device not in ("cpu", "cuda"):
        raise UserError(f"device must be one of auto, cpu, cuda, got '{device}'")
    return torch.device(rank_device(device))


def import_ahead(ref: ModelRef, pipeline: str | None = None) -> None:
    """Import what loading and running `ref` imports first (diffusers' classes of its family, the
    variant's pipeline, accel's runner): a CPU job's ranks are forks of this process and then find
    them loaded, where each would import them again."""
    import importlib

    import diffusers

    importlib.import_module("accel.runner")
    family = ref.family
    names = (*family.pipeline_classes, *family.transformer_classes, *family.vaes) if family is not None else ()
    for name in (*names, *(name for name in (pipeline, ref.pipeline) if name)):
        getattr(diffusers, name, None)  # diffusers imports a class's module on first access


def load_pipeline(
    name_or_path: str,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    pipeline: str | None = None,
    lora: Sequence[str] | None = None,
    components: Mapping[str, str] | None = None,
    tp_slice: tuple[int, int] | None = None,
    text_encoders: bool = True,
    text_encoders_on_cpu: bool = False,
    text_encoders_tp: int = 1,
    vae_on_cpu: bool = False,
) -> Any:
    """A diffusers pipeline ready to call, on `device` in `dtype`, for any name accel understands;
    `pipeline` names another pipeline class of the same transformer to run it as (FluxKontextPipeline);
    `lora` lists LoRA weights ("PATH@SCALE") fused into its weights; `components` the folders of
    components the variant needs beyond the model's (`Variant.components`), by name. `tp_slice`
    (degree, index): read only that tensor-parallel slice of the transformer's split weights
    (accel/models/split_load.py) where the checkpoint allows it (safetensors of a family with a
    TensorPlan, no LoRA to fuse); otherwise the whole model loads and `accel.apply` splits it.
    `text_encoders=False`: leave the text encoders out (a rank that receives its embeddings from
    the rank that encodes, [memory] text_encoder = "rank0"); `text_encoders_on_cpu`: they stay in host
    memory while the rest goes to `device` ("cpu"), never passing through the GPU. `text_encoders_tp`
    > 1 ([memory] text_encoder = "sharded"): each text encoder that transformers has a tensor-parallel
    plan for loads split over that many ranks, which must be the whole job (transformers builds its
    mesh over every rank), each reading only its slice; a tiny variant's are split by `accel.apply`.
    `vae_on_cpu`: the VAE stays in host memory (a rank that does not decode, [memory] vae = "rank0")."""
    loras = parse_loras(lora)  # a missing file is one line before a long load
    ref = resolve_model(name_or_path)
    torch_dtype = resolve_dtype(dtype, ref)
    target = resolve_device(device)
    if ref.tiny:
        assert ref.family is not None and ref.family.tiny is not None
        variant = variant_of(ref.family, pipeline) if pipeline else None
        pipe = (variant.tiny if variant is not None and variant.tiny else ref.family.tiny)()  # built in float32
        if not text_encoders:
            from accel.parallel.encoders import text_encoder_names

            pipe.register_modules(**{name: None for name in text_encoder_names(pipe)})
        if torch_dtype != torch.float32:
            pipe.to(torch_dtype)
    else:
        split = tp_slice if tp_slice is not None and tp_slice[0] > 1 and not loras else None
        pipe = _from_pretrained(ref, torch_dtype, split, target, text_encoders, text_encoders_tp)
    family = family_of(pipe)  # refuse pipelines accel cannot accelerate now, not at apply time
    variant = variant_of(family, pipeline) if pipeline else variant_of_class(family, type(pipe))
    converted = bool(pipeline) and type(pipe).__name__ != pipeline
    extra = _components(variant, component_folders(variant, components or {}, converted), torch_dtype, converted)
    if converted:
        _refuse_other_transformer(pipe, family, variant)
        _refuse_other_config(pipe, variant)
        pipe = _as_pipeline(pipe, variant.pipeline_class, extra)
    else:
        _refuse_other_config(pipe, variant)
        pipe.register_modules(**extra)
    _place(pipe, target, text_encoders_on_cpu, vae_on_cpu)
    fuse_loras(pipe, loras)
    return pipe


def _place(pipe: Any, target: torch.device, text_encoders_on_cpu: bool, vae_on_cpu: bool = False) -> None:
    from accel.parallel.encoders import text_encoder_names
    from accel.vae.placement import takes_output_type

    on_cpu = set(text_encoder_names(pipe)) if text_encoders_on_cpu else set()
    if vae_on_cpu and takes_output_type(pipe):  # else its call cannot skip the decode: the VAE must be on the device
        on_cpu.add("vae")
    if not on_cpu:
        pipe.to(target)
        return
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module) and name not in on_cpu:
            component.to(target)


def _refuse_other_transformer(pipe: Any, family: Family, variant: Any) -> None:
    """Where a family's pipelines hold different transformer classes (Wan and Wan VACE), a pipeline
    cannot run another class's checkpoint: one line, not a missing-argument error mid-run."""
    transformer = getattr(pipe, "transformer", None)
    expected = variant.transformer_class or family.transformer_class
    if len(family.transformer_classes) < 2 or transformer is None:
        return
    if expected not in {cls.__name__ for cls in type(transformer).__mro__}:
        raise ModelError(
            f"[model] pipeline: {variant.pipeline_class} needs a {expected} checkpoint, and this model's "
            f"transformer is {type(transformer).__name__}; load a checkpoint made for {variant.pipeline_class}"
        )


def _refuse_other_config(pipe: Any, variant: Any) -> None:
    """A variant whose transformer needs another config than this checkpoint's (SkyReels-V1 I2V's
    32 input channels on a 16-channel text-to-video model): one line, not a shape error mid-run."""
    config = getattr(getattr(pipe, "transformer", None), "config", {})
    for key, value in variant.transformer_config:
        if config.get(key) != value:
            raise ModelError(
                f"[model] pipeline: {variant.pipeline_class} needs a transformer with {key} = {value!r}, and this "
                f"model's has {config.get(key)!r}; load a checkpoint made for {variant.pipeline_class}"
            )


def _components(variant: Any, folders: Mapping[str, str], torch_dtype: torch.dtype, converted: bool) -> dict[str, Any]:
    """The variant's own components: each loaded from its folder where one is given, else, where the
    model is `converted` to the variant, built without weights where it can be (a scheduler); the
    rest the model holds (a tiny variant's builder made them)."""
    import importlib

    made: dict[str, Any] = {}
    for component in variant.components:
        if component.name in folders:
            module, _, name = component.cls.rpartition(".")
            cls = getattr(importlib.import_module(module), name)
            try:
                made[component.name] = cls.from_pretrained(folders[component.name], torch_dtype=torch_dtype)
            except (OSError, ValueError) as error:
                raise ModelError(
                    f"[model] components: {component.name}: {folders[component.name]} could not be loaded as {name} "
                    f"({_first_line(error)})"
                ) from None
        elif component.build is not None and converted:
            made[component.name] = component.build()
    return made


def _as_pipeline(pipe: Any, pipeline_class: str, components: Mapping[str, Any] | None = None) -> Any:
    """The same components under another pipeline class (with `components` added or replaced); a
    component it lacks is one line."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    try:
        return cls.from_pipe(pipe, **(components or {}))
    except ValueError as error:
        raise ModelError(
            f"[model] pipeline: {pipeline_class} cannot run this model's components ({_first_line(error)})"
        ) from None


def _from_pretrained(
    ref: ModelRef,
    torch_dtype: torch.dtype,
    split: tuple[int, int] | None = None,
    device: torch.device | None = None,
    text_encoders: bool = True,
    text_encoders_tp: int = 1,
) -> Any:
    from diffusers import DiffusionPipeline
    from diffusers.utils import deprecation_utils
    from safetensors import SafetensorError

    folder = Path(ref.source)
    if folder.is_dir():  # a fault in the folder is one line naming its file, not a library traceback
        check_folder(folder, read_index(folder))
    # diffusers renamed torch_dtype to dtype (0.42 warns on the old name); use what this one takes.
    dtype_arg = "dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"
    try:
        made: dict[str, Any] = (
            dict(ref.family.load_kwargs()) if ref.family is not None and ref.family.load_kwargs else {}
        )
        if (
            split or not text_encoders or text_encoders_tp > 1
        ):  # a hub model's folder in the local cache, downloaded if need be
            root = folder if folder.is_dir() else Path(DiffusionPipeline.download(ref.source, use_safetensors=True))
            made = _split_transformers(ref, root, torch_dtype, split, device or torch.device("cpu")) if split else {}
            if not text_encoders:  # passed as None: diffusers does not load them
                made.update({name: None for name in _text_encoders_of(root)})
            elif text_encoders_tp > 1:
                made.update(_sharded_text_encoders(root, torch_dtype, text_encoders_tp))
            if _optional(ref, made):
                return _assembled(root, made, torch_dtype, dtype_arg)
        # use_safetensors: never unpickle a checkpoint (it can run code); the folder check names the file.
        return DiffusionPipeline.from_pretrained(ref.source, use_safetensors=True, **made, **{dtype_arg: torch_dtype})
    except (OSError, ValueError, SafetensorError, pickle.UnpicklingError) as error:
        if folder.is_dir():
            raise ModelError(
                f"{ref.source} could not be loaded ({_reason(error)}); re-download or re-save the pipeline"
            ) from None
        raise ModelError(
            f"model '{ref.source}' is not available locally and could not be downloaded "
            f"({_reason(error)}); fetch it with `hf download {ref.source}` (log in with "
            "`hf auth login` and accept the licence on its model page if it is gated) or pass a local folder"
        ) from None


def _split_transformers(
    ref: ModelRef, root: Path, torch_dtype: torch.dtype, split: tuple[int, int], device: torch.device
) -> dict[str, Any]:
    """Each transformer of the model in `root` as its TP slice `split`, by attribute (empty: load it whole)."""
    from accel.models.split_load import load_split_transformer, transformer_folders

    family = ref.family
    if family is None or family.tensor is None:
        return {}
    return {
        attr: load_split_transformer(cls, folder, family.tensor, torch_dtype, device, *split)
        for attr, (cls, folder) in transformer_folders(root, family.transformer_attrs).items()
    }


def _optional(ref: ModelRef, made: Mapping[str, Any]) -> bool:
    """Whether any of `made` is an optional component of the model's pipeline class, which diffusers'
    from_pretrained loads from the folder even when it is passed in (Wan's transformer, optional for
    Wan 2.2's two experts): then the pipeline is assembled here instead of loading it whole first."""
    import diffusers

    cls = getattr(diffusers, ref.family.pipeline_class, None) if ref.family is not None else None
    loaded = {name for name, model in made.items() if model is not None}
    return bool(loaded) and (cls is None or bool(loaded & set(getattr(cls, "_optional_components", ()))))


def _sharded_text_encoders(root: Path, torch_dtype: torch.dtype, tp: int) -> dict[str, Any]:
    """Each text encoder of `root` that transformers has a TP plan for, loaded by transformers split
    over `tp` ranks (its `DistributedConfig`: every rank reads only its slice, onto its own device)."""
    import json

    import transformers
    from transformers.distributed import DistributedConfig

    from accel.parallel.encoders import class_has_tp_plan

    index = json.loads((root / "model_index.json").read_text())
    made = {}
    for name in _text_encoders_of(root):
        cls = getattr(transformers, str(index[name][-1]), None) if index[name][0] == "transformers" else None
        if cls is not None and class_has_tp_plan(cls):
            made[name] = cls.from_pretrained(
                root / name, dtype=torch_dtype, distributed_config=DistributedConfig(tp_size=tp)
            )
    return made


def _text_encoders_of(root: Path) -> list[str]:
    """The text encoder components model_index.json names (text_encoder, text_encoder_2, …)."""
    import json

    index = json.loads((root / "model_index.json").read_text())
    return [
        name
        for name, value in index.items()
        if name.startswith("text_encoder") and isinstance(value, list) and value and value[0] is not None
    ]


def _assembled(root: Path, made: Mapping[str, Any], torch_dtype: torch.dtype, dtype_arg: str) -> Any:
    """The pipeline of `root`'s model_index.json from `made` and each other component's own
    from_pretrained (its folder, in `torch_dtype` where it is a model), plus the pipeline's settings."""
    import importlib
    import inspect
    import json

    import diffusers

    index = json.loads((root / "model_index.json").read_text())
    pipeline_class = getattr(diffusers, index["_class_name"])
    accepted = inspect.signature(pipeline_class.__init__).parameters
    kwargs: dict[str, Any] = {}
    for name, value in index.items():
        if name.startswith("_") or name not in accepted:
            continue
        if name in made:  # loaded here, or a setting the family loads with (Cosmos 3's enable_safety_checker)
            kwargs[name] = made[name]
        elif not (isinstance(value, list) and len(value) == 2):
            kwargs[name] = value  # a pipeline setting (Wan 2.2's boundary_ratio)
        elif value[0] is None:
            kwargs[name] = None
        else:
            cls = getattr(importlib.import_module(value[0]), value[1])
            model = isinstance(cls, type) and issubclass(cls, torch.nn.Module)
            # transformers took torch_dtype before 4.56; diffusers' name is dtype_arg.
            key = dtype_arg if value[0] == "diffusers" else ("dtype" if _transformers_take_dtype() else "torch_dtype")
            kwargs[name] = cls.from_pretrained(root / name, **({key: torch_dtype} if model else {}))
    return pipeline_class(**kwargs)


def _transformers_take_dtype() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("4.56")


def _reason(error: BaseException) -> str:
    """The library's reason, for a message in parentheses; a pickle's never (it would suggest unpickling)."""
    text = str(error)
    if isinstance(error, pickle.UnpicklingError) or "weights_only" in text:
        return "a weights file is a pickle, which accel will not load for safety; convert it to safetensors"
    return _first_line(error)


def _first_line(error: BaseException, limit: int = 200) -> str:
    """The error's first line, cut at a word boundary with an ellipsis if it is longer than `limit`."""
    lines = str(error).strip().splitlines()
    text = lines[0].strip() if lines else type(error).__name__
    if len(text) <= limit:
        return text
    cut = text[: limit + 1].rsplit(" ", 1)[0] if " " in text[:limit] else text[:limit]
    return cut.rstrip(" ,;:.") + "…"

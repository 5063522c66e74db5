"""What a model family contributes: data about its pipeline, never engine code."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from accel.parallel.plan_format import FamilyPlan, TensorPlan

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

    from accel.models.variant_format import Variant

# What a pipeline makes: pictures, videos with frames in [0, 1], or videos of linear light in [0, inf)
# (LTX-2's HDR IC-LoRA pipeline), which no 8-bit file holds whole.
OutputKind = Literal["image", "video", "hdr-video"]
# How each kind is named in messages, and the files accel writes it as: (suffix, what that file holds),
# the first one for a name accel picks itself. An HDR video's .mp4 is an SDR preview (linear values
# clipped to [0, 1], then the sRGB transfer function), its .npy the linear float32 frames (frames, H, W, 3).
OUTPUT_FILES: dict[OutputKind, tuple[str, tuple[tuple[str, str], ...]]] = {
    "image": ("images", ((".png", "a PNG picture"),)),
    "video": ("videos", ((".mp4", "an H.264 video"),)),
    "hdr-video": ("linear HDR videos", ((".mp4", "an SDR preview"), (".npy", "the linear float32 frames"))),
}
# How a pipeline runs classifier-free guidance: both branches batched into one transformer call,
# or one transformer call per branch per step.
CfgStyle = Literal["batch", "calls"]


@dataclass(frozen=True)
class BlockList:
    """One list of repeated transformer blocks, in the order the transformer runs them.

    `returns` names what a block's forward returns, in order (one name: a bare tensor). Every
    name is also one of the block's forward arguments, which lets the cache pass a skipped
    block's inputs straight through. `joins` names streams of the first list that the transformer
    concatenates along the token dim into this list's one stream (FLUX.2's single blocks run on
    text then image in one tensor), so the cache can measure this list's output from the first block's.
    """

    attr: str
    returns: tuple[str, ...]
    joins: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationDefaults:
    """Settings a user should start from; `None` leaves the pipeline's own default."""

    prompt: str = "a red fox in the snow, photograph"
    negative_prompt: str | None = None
    steps: int = 28
    height: int = 1024
    width: int = 1024
    frames: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    # What `accel tune --target` measures quality on when the user gives no --prompts (empty: the
    # pair for the family's output kind, TUNE_PROMPTS).
    tune_prompts: tuple[str, ...] = ()


# Two prompts of different content: a cache setting must hold its quality on both, not one.
TUNE_PROMPTS: dict[str, tuple[str, ...]] = {
    "image": ("a red fox in the snow, photograph", "a lighthouse on a rocky coast at dusk, oil painting"),
    "video": (
        "a red fox trotting through the snow, photograph",
        "waves breaking on a rocky coast at dusk, the camera pans slowly",
    ),
}


@dataclass(frozen=True)
class AudioOutput:
    """Where a pipeline that makes sound with its video puts it, so the runner can carry it into
    the MP4: `field` of the pipeline's output holds (batch, channels, samples) in [-1, 1] (without
    `batched`: one sample's (channels, samples), as Cosmos 3's), and the dotted attribute path
    `sample_rate` on the pipeline gives its rate in Hz."""

    field: str = "audio"
    sample_rate: str = "vocoder.config.output_sampling_rate"
    batched: bool = True


@dataclass(frozen=True)
class ResultField:
    """Where a pipeline's result holds its pictures or frames when not in diffusers' usual batched
    `frames`, `images` or `image` field: `name` the field, `batched` False where it holds one
    sample (Cosmos 3's `video`: (frames, H, W, 3) whatever the prompt list)."""

    name: str
    batched: bool = True


@dataclass(frozen=True)
class Acceleration:
    """What accelerating a transformer needs, and all it needs: its repeated blocks, the stream the
    cache compares, the plans that split it, how its pipeline runs guidance. The generic path learns
    one from the model itself (accel/models/generic.py `learned_acceleration`); a hand-written family
    states its own, where the learned one lacks something (a CFG style, a tensor plan, a hand plan
    sending less) or a test pins it: `dataclasses.replace(learned, cfg="calls")` is a named family's
    record with one override."""

    blocks: tuple[BlockList, ...]
    # Which block stream the cache compares between steps.
    primary_stream: str = "hidden_states"
    # Pipeline attributes that hold a transformer (Wan 2.2 adds a low-noise `transformer_2`).
    transformer_attrs: tuple[str, ...] = ("transformer",)
    # The transformer config key that holds its head count (Z-Image's says `n_heads`), or, for a
    # config that states none, the count as a function of the config (Kandinsky 5: width / head width).
    heads_key: str = "num_attention_heads"
    heads_of_config: Callable[[Mapping[str, Any]], int] | None = None
    # Context parallelism; None: the family runs on one process only.
    parallel: FamilyPlan | None = None
    # Tensor parallelism; None: the family's weights are not split.
    tensor: TensorPlan | None = None
    # Classifier-free guidance: how the pipeline runs it (None: it has none), and the generation
    # setting that turns it on when above 1 (with a negative prompt where `cfg_needs_negative`).
    cfg: CfgStyle | None = None
    cfg_scale: str = "guidance_scale"
    # Guidance runs when the scale is above this (1 for most pipelines; Z-Image's runs above 0).
    cfg_above: float = 1.0
    cfg_needs_negative: bool = False
    # The two guidance calls' outputs may differ in shape (Qwen-Image 2.1's first call returns the
    # prompt's tokens too, and the prompts differ in length): CFG parallelism then exchanges shapes
    # before results, a host synchronisation the other families do without.
    cfg_outputs_vary: bool = False
    # A transformer whose output is several predictions (Cosmos 3 returns its vision, sound and action
    # lists): given a call's arguments, that output's structure as the call returns it, each prediction
    # replaced by a tensor of its shape, dtype and device, so that CFG parallelism can answer the other
    # branch's call with placeholders before it is computed. None: the output is one sample tensor.
    cfg_output_like: Callable[[Mapping[str, Any]], Any] | None = None
    # diffusers attention processors that accel swaps for an equivalent needing less memory, on every
    # module that uses one: (the diffusers class's name, a factory of accel's). Same outputs for every
    # real token (accel/optimize/processors.py installs them in every apply and in the memory plan).
    processors: tuple[tuple[str, Callable[[], Any]], ...] = ()
    # Learned by accel/models/generic.py from the model itself (a pipeline no family describes), not a
    # tested family: its context parallelism is the automatic plan, verified before use; what it
    # does not know (CFG and tensor parallelism) is refused.
    learned: bool = False
    # Why the step caches cannot run on these blocks (a learned record whose lists run interleaved).
    cache_refused: str | None = None

    def heads_in(self, config: Mapping[str, Any]) -> int | None:
        """The attention heads a transformer config gives (None: it does not say)."""
        if self.heads_of_config is not None:
            return self.heads_of_config(config)
        heads = config.get(self.heads_key)
        return int(heads) if isinstance(heads, int) else None


@dataclass(frozen=True)
class Family:
    """A model family: its `acceleration` record, and beside it what accel needs to recognise, load,
    call and test its pipelines (classes, checkpoint, call defaults, inputs and outputs, tiny builders).
    The record's fields read as the family's own (`family.blocks`)."""

    name: str
    title: str
    pipeline_class: str
    transformer_class: str
    repo: str
    output: OutputKind
    dtype: str
    defaults: GenerationDefaults
    acceleration: Acceleration
    # Keyword the pipeline takes for the frame count (video families).
    frames_arg: str | None = None
    # Sizes the pipeline makes as asked: heights and widths in multiples of `size_step` pixels (the
    # VAE's downscale times the latent patch), frame counts of the form frame_step * k + 1 (a causal
    # video VAE's temporal downscale). Other values diffusers rounds silently or refuses mid-run, so
    # accel refuses them up front, naming the neighbours; 0: not known, nothing refused.
    size_step: int = 0
    frame_step: int = 0
    # The pipeline's tokenizers that read the whole prompt, whose cuts accel reports (None: every
    # `tokenizer*` component; HunyuanVideo 1.5's ByT5 reads only the quoted text to render).
    prompt_tokenizers: tuple[str, ...] | None = None
    # Whether the pipeline takes `true_cfg_scale` (FLUX runs its negative prompt only when it is > 1).
    true_cfg: bool = False
    # Frame rate the family's videos are meant to play at.
    fps: int = 24
    # Attention heads of the default repo's transformer and of the tiny variant: Ulysses degrees
    # are checked against them before any rank starts.
    heads: int | None = None
    tiny_heads: int | None = None
    # The diffusers class of the family's VAE, whose parallel decode accel/models/vaes.py describes.
    vae: str | None = None
    tiny: Callable[[], DiffusionPipeline] | None = None
    tiny_defaults: GenerationDefaults | None = None
    # The other pipelines of this transformer that accel runs, with the inputs their calls need.
    variants: tuple[Variant, ...] = ()
    # Sound generated with the video (LTX-2), muxed into the MP4; None: the pipeline makes none.
    audio: AudioOutput | None = None
    # Where the pipeline's result holds its output, if not in a usual field (None: frames, images or image).
    result: ResultField | None = None
    # Whether one call of several prompts gives each sample the output its own call makes (accel serve
    # --max-batch): False where diffusers' pipeline mixes them (the padding of the longest prompt
    # changes the others', the call fails for more than one) or it is not tested.
    batches: bool = True
    # Keyword arguments `from_pretrained` gets for a checkpoint of this family, as this environment
    # needs them (Cosmos 3 without `cosmos_guardrail`: no safety checker); None: none.
    load_kwargs: Callable[[], Mapping[str, Any]] | None = None

    def with_acceleration(self, **changes: Any) -> Family:
        """This family with fields of its acceleration record replaced (`parallel=None`)."""
        return replace(self, acceleration=replace(self.acceleration, **changes))

    @property
    def blocks(self) -> tuple[BlockList, ...]:
        return self.acceleration.blocks

    @property
    def primary_stream(self) -> str:
        return self.acceleration.primary_stream

    @property
    def transformer_attrs(self) -> tuple[str, ...]:
        return self.acceleration.transformer_attrs

    @property
    def heads_key(self) -> str:
        return self.acceleration.heads_key

    @property
    def parallel(self) -> FamilyPlan | None:
        return self.acceleration.parallel

    @property
    def tensor(self) -> TensorPlan | None:
        return self.acceleration.tensor

    @property
    def cfg(self) -> CfgStyle | None:
        return self.acceleration.cfg

    @property
    def cfg_scale(self) -> str:
        return self.acceleration.cfg_scale

    @property
    def cfg_above(self) -> float:
        return self.acceleration.cfg_above

    @property
    def cfg_outputs_vary(self) -> bool:
        return self.acceleration.cfg_outputs_vary

    @property
    def processors(self) -> tuple[tuple[str, Callable[[], Any]], ...]:
        return self.acceleration.processors

    @property
    def learned(self) -> bool:
        return self.acceleration.learned

    @property
    def cache_refused(self) -> str | None:
        return self.acceleration.cache_refused

    def cfg_off(self, call: Mapping[str, Any]) -> str | None:
        """Why a pipeline call with these arguments runs no classifier-free guidance (None: it runs it)."""
        if self.cfg is None:
            if self.learned:
                return f"accel has not learned how {self.title} runs classifier-free guidance (no family describes it)"
            return f"{self.title} pipelines have no classifier-free guidance"
        scale = call.get(self.cfg_scale)
        if scale is None or scale <= self.cfg_above:
            return (
                f"{self.cfg_scale} is {'not set' if scale is None else scale}, and guidance runs only above "
                f"{self.cfg_above:g}"
            )
        if self.acceleration.cfg_needs_negative and not call.get("negative_prompt"):
            return f"there is no negative prompt, which {self.title} needs for true CFG"
        return None

    def heads_in(self, config: Mapping[str, Any]) -> int | None:
        """The attention heads a transformer config gives (None: it does not say)."""
        return self.acceleration.heads_in(config)

    def size_problem(self, key: str, value: int) -> str | None:
        """Why `[generate] key = value` (height, width or frames) is not a size this family makes
        as asked, naming the nearest ones it does make (None: it makes it)."""
        step = self.frame_step if key == "frames" else self.size_step
        if not step:
            return None
        low = (value - 1) // step * step + 1 if key == "frames" else value // step * step
        if low == value:
            return None
        rule = (
            f"{step}k+1 frames (1, {step + 1}, {2 * step + 1}, …)"
            if key == "frames"
            else f"{key}s in multiples of {step} pixels"
        )
        smallest = 1 if key == "frames" else step
        use = " or ".join(str(n) for n in (low, low + step) if n >= smallest)
        return f"[generate] {key} {value}: {self.title} makes {rule}; use {use}"

    @property
    def transformer_classes(self) -> tuple[str, ...]:
        """The family's transformer class, then its variants' own ones: each makes a pipeline this family."""
        others = (
            v.transformer_class
            for v in self.variants
            if v.transformer_class and v.transformer_class != self.transformer_class
        )
        return tuple(dict.fromkeys((self.transformer_class, *others)))

    def plan_for(self, transformer: Any) -> FamilyPlan | None:
        """The context-parallel plan for this transformer instance: a variant's own transformer
        class (or a subclass of it) has its own plan (None: none), anything else the family's."""
        names = {cls.__name__ for cls in type(transformer).__mro__}
        for variant in self.variants:
            if variant.transformer_class in names:
                return variant.parallel
        return self.parallel

    def output_of(self, pipeline_class: str) -> OutputKind:
        """What `pipeline_class` makes: its variant's own output kind where it says one, else the family's."""
        kinds = [
            variant.output for variant in self.variants if variant.pipeline_class == pipeline_class and variant.output
        ]
        return kinds[0] if kinds else self.output

    def tune_prompts(self, pipeline_class: str) -> tuple[str, ...]:
        """The prompts `accel tune --target` measures on without --prompts: the family's own, else
        the built-in pair for what `pipeline_class` makes."""
        return (
            self.defaults.tune_prompts
            or TUNE_PROMPTS["image" if self.output_of(pipeline_class) == "image" else "video"]
        )

    @property
    def outputs(self) -> tuple[OutputKind, ...]:
        """The family's output kind, then any other its variants make."""
        return tuple(dict.fromkeys((self.output, *(variant.output for variant in self.variants if variant.output))))

    @property
    def vaes(self) -> tuple[str, ...]:
        """The family's VAE class, then its variants' own ones."""
        return tuple(dict.fromkeys(name for name in (self.vae, *(variant.vae for variant in self.variants)) if name))

    @property
    def pipeline_classes(self) -> tuple[str, ...]:
        """The family's own pipeline class, then its variants'."""
        others = (variant.pipeline_class for variant in self.variants if variant.pipeline_class != self.pipeline_class)
        return (self.pipeline_class, *others)

    @property
    def tiny_alias(self) -> str | None:
        return f"tiny-{self.name}" if self.tiny is not None else None

"""What a model family contributes: data about its pipeline, never engine code."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

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
class SequenceSplit:
    """One tensor cut along its token dim over the sequence-parallel ranks.

    `value` names an argument of `module`'s forward ("" is the transformer itself; a dotted
    pattern where `*` stands for one name, such as "blocks.*", hooks every block), or is
    "output" for what the module returns (each tensor of a returned tuple, e.g. a rotary (cos, sin)
    pair). Tensors of one `stream` (video latents and their rotary embedding) share one layout; a
    tuple of streams means the tensor is those streams concatenated along `dim` (a joint attention
    mask over video then text). With `ndim` set, only tensors of that rank are cut (Wan 2.2's
    per-token timesteps are cut, its per-sample ones are not). With `element` set, only that item
    of a returned (or passed) tuple is cut, so one tuple can hold several streams (Qwen-Image's
    rotary module returns the image table and the text table together). With `broadcast`, a tensor
    of one entry along `dim` is one value for every token and stays whole (LTX-Video's condition
    pipeline passes (batch, 1) timesteps without conditions, (batch, tokens) with them). A list,
    tuple or mapping is cut item by item (a ControlNet's per-block residuals). `at` defers the cut
    of a transformer argument (module "") to just before the modules it names start, for a stream
    that only exists inside the forward (Z-Image's unified sequence is built there); the list or
    mapping the transformer holds is then filled in place.
    """

    value: str
    stream: str | tuple[str, ...]
    dim: int = -2
    module: str = ""
    ndim: int | None = None
    element: int | None = None
    at: str = ""
    broadcast: bool = False

    @property
    def streams(self) -> tuple[str, ...]:
        return self.stream if isinstance(self.stream, tuple) else (self.stream,)


@dataclass(frozen=True)
class GroupedTokens:
    """A module that works on a cut stream's tokens in equal consecutive groups, each group with its
    own item of another argument: Wan Animate's face adapter attends from each latent frame's tokens
    to that frame's motion tokens (`value` the video tokens along `dim`, `by` the motion tokens, one
    item per frame along `by_dim`). Its processor regroups the tokens it is given by position, so a
    rank's shard alone would be grouped wrongly.

    Each rank runs the module on its own real tokens, cut where groups begin into at most three
    runs (the end of a group the previous rank began, whole groups, the start of a group the next
    rank ends), each run with its groups' items of `by`, and joins the outputs. This is exact at any
    token count and wherever the ranks cut a group, provided the module is token-wise apart from its
    groups (a token's output depends on that token and its group's `by` items alone: per-token norms
    and projections, attention from a group's tokens to its `by` items) and takes a group's length
    from its input (tokens over `by` items), so part of one group is a group of its own. It exchanges
    nothing and computes no token twice, at the price of at most two extra calls of a small module.
    The alternatives cost more: gathering the sequence whole before the module is an all-gather of it
    and the whole module on every rank; padding a rank's tokens to whole groups computes up to two
    groups of padding per rank, more than a shard at many ranks. The module's attention runs
    locally: its keys are `by`'s, which every rank holds whole.
    """

    module: str
    stream: str
    value: str = "hidden_states"
    by: str = "encoder_hidden_states"
    dim: int = 1
    by_dim: int = 1


@dataclass(frozen=True)
class LeadingCount:
    """An integer argument `value` of `module` (a dotted pattern, as in SequenceSplit; "" is the
    transformer itself) that counts the leading tokens of `stream` which the module treats apart:
    HunyuanVideo I2V's blocks modulate the first latent frame (the clean picture) with their own
    shift, scale and gate. Under a token split each rank gets how many of its own shard's real
    tokens are among them (0 past them), so the same tokens are treated apart as on one process.
    The stream must be cut by the time the module runs. `when` (config key, value) limits it to
    transformers of that config (the same class's text-to-video blocks take no such argument).
    `trailing`: the argument counts the stream's last tokens instead, the tokens before them being
    the ones treated apart: Helios's blocks take the length of the chunk being denoised, which
    follows its history tokens, and give only the chunk cross-attention. Each rank then gets its
    shard's length less the leading tokens it holds, so its padding (at the shard's end) counts
    with the chunk and the rank divides its shard where one process divides the sequence.
    """

    value: str
    stream: str
    module: str = ""
    when: tuple[str, Any] | None = None
    trailing: bool = False


@dataclass(frozen=True)
class ParallelPlan:
    """What context parallelism does to a family's transformer, as data for the generic engine.

    `attention_keys` lists, in order, the streams that make up the keys of the transformer's
    attention calls (FLUX attends over text then image tokens). A listed stream that no split
    cuts is replicated: every rank holds all of it (Mochi's text, compacted per sample), and the
    engine shares its attention work out for the call; where the call's queries are the cut
    streams' alone, the replicated keys are attended by every rank's queries locally and merged
    with the cut keys' attention by log-sum-exp (Qwen-Image 2.1's cached prompt keys). `local_attention` names modules
    (glob
    patterns) whose attention every rank runs on its own tokens unchanged: cross-attention to
    replicated text, a text refiner. The output is gathered where `output_module` returns ("" is
    the transformer's own output). `batch_args` are the transformer arguments that carry the
    batch dim, which CFG parallelism halves when the pipeline batches its CFG branches.
    `module_keys` gives modules (glob patterns) whose attention has other keys than
    `attention_keys`: SD 3.5 medium's second attention in its first blocks attends over the image
    tokens alone, `("transformer_blocks.*.attn2", ("image",))`. `pairwise_mask`: the model's
    attention masks are (B, 1, L, L), one per-token mask ANDed with itself (query and key alike;
    HunyuanVideo 1.5 builds one in every block). The engine reads the key mask off the diagonal,
    with no host sync; a masked query (a padding token) then attends to the real keys instead of
    none, which changes only rows no real token reads. `batch_items` are arguments holding
    several tensors that each carry the batch dim (a list or mapping of them: a ControlNet's
    per-block residuals), which CFG parallelism halves tensor by tensor; where a split of one is
    deferred `at` a module, its tensors are padded like that module's first input (to the batch's
    longest sample), and a half that runs shorter samples keeps only as many tokens. In a module pattern a negative
    index counts from the end of its list: `"visual_transformer_blocks.-1"` is the last block
    (Kandinsky 5 reshapes its tokens to a video grid right after it, so the output is gathered there).
    `refuses` lists transformer configs the plan cannot split, as (config key, value, why):
    the engine refuses them with one line instead of attending on each rank's shard alone. `whole_queries` names modules
    (glob patterns) whose queries are a replicated stream every rank holds whole while their keys
    are cut (LTX-2's audio attending to the video): each rank attends with all queries to its own
    keys, and the partial results merge by log-sum-exp over the ranks (one all-gather of a
    query-sized result, no keys exchanged). `grouped` lists modules that work on a cut stream's
    tokens group by group (see GroupedTokens).
    """

    splits: tuple[SequenceSplit, ...]
    attention_keys: tuple[str, ...]
    output_stream: str
    output_dim: int = -2
    output_module: str = ""
    local_attention: tuple[str, ...] = ()
    batch_args: tuple[str, ...] = ()
    module_keys: tuple[tuple[str, tuple[str, ...]], ...] = ()
    pairwise_mask: bool = False
    batch_items: tuple[str, ...] = ()
    refuses: tuple[tuple[str, Any, str], ...] = ()
    whole_queries: tuple[str, ...] = ()
    grouped: tuple[GroupedTokens, ...] = ()
    leading_counts: tuple[LeadingCount, ...] = ()
    # Streams no split cuts that a split of several streams may span: their part of the tensor stays
    # whole on every rank (a rotary table over the whole text and the cut image, where the text is
    # replicated), its length what the cut streams leave of the tensor.
    whole_streams: tuple[str, ...] = ()
    # The output is gathered from `output_module`'s first argument before the module runs, not from
    # what it returns: everything after the blocks then runs on the whole sequence (the automatic plan).
    output_before: bool = False
    # Where a plan no family wrote came from ("automatic", "diffusers _cp_plan"): what reports name.
    origin: str = ""
    # (transformer argument, value): only calls passing that value are cut; every other call runs
    # whole on every rank, its attention unrouted. Qwen-Image 2.1's first call a step fills its K/V
    # cache with the whole prompt ("extract"); the calls after ("cached") compute the target alone,
    # attending to those cached keys, which every rank then holds whole (a replicated stream that is
    # keys only: see `attention_keys`).
    split_only_when: tuple[str, Any] | None = None
    # Attention called causal (is_causal) runs on every rank unchanged: the plan keeps its tokens whole
    # on every rank (Cosmos 3's text, attending causally to itself in every layer beside the video's
    # call, which is routed).
    causal_local: bool = False


@dataclass(frozen=True)
class AutomaticPlan:
    """Context parallelism learned from the model itself when it is applied, and verified on
    simulated ranks before use (accel/parallel/automatic.py, accel/parallel/verify.py): what a
    pipeline no family describes gets (its class's own `_cp_plan` tried first, its streams learned),
    and what `[parallel] plan = "automatic"` asks of any family (the automatic plan alone)."""


@dataclass(frozen=True)
class FromDiffusers:
    """A ParallelPlan derived, when applied, from the transformer class's own diffusers `_cp_plan`.

    diffusers says which tensors are cut on which dim at which module and where the output is
    gathered; it does not say which of them are one sequence. `streams` adds that: each cut's
    stream, keyed by its argument name, or by "module[index]" for an item of a module's returned
    tuple ("pos_embed[0]"). The other fields are the ParallelPlan's. `extra_splits` are cuts
    diffusers' plan lacks; `keep_whole` names cuts of diffusers' plan (keyed as in `streams`) that
    accel leaves whole on every rank (LTX-2's text, whose additive mask the engine cannot split and
    whose cross-attention then needs no exchange). See accel/parallel/derive.py.
    """

    streams: tuple[tuple[str, str], ...]
    attention_keys: tuple[str, ...]
    output_stream: str
    local_attention: tuple[str, ...] = ()
    batch_args: tuple[str, ...] = ()
    module_keys: tuple[tuple[str, tuple[str, ...]], ...] = ()
    extra_splits: tuple[SequenceSplit, ...] = ()
    batch_items: tuple[str, ...] = ()
    whole_queries: tuple[str, ...] = ()
    keep_whole: tuple[str, ...] = ()
    grouped: tuple[GroupedTokens, ...] = ()


@dataclass(frozen=True)
class Packed:
    """A fused layer whose width is several parts side by side (SwiGLU's value and gate, Q K V and
    the MLP input in one projection): each part is split over the TP ranks on its own, so every
    rank holds a slice of each. `parts` are proportions ((1, 1): two equal halves); empty reads the
    absolute sizes diffusers stores on the Linear (`_tp_packed_col_blocks` / `_tp_packed_row_blocks`)."""

    style: Literal["colwise", "rowwise"]
    parts: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rotary:
    """Rotary embeddings a module takes as keyword `arguments` (tensors, or tuples of them such as
    (cos, sin)) that span all heads, where a TP rank runs only its own: the rank takes its heads'
    slice before the module runs. `heads_dim` maps a tensor's number of dims to the dim holding the
    heads (or the whole width, heads side by side): LTX's (batch, tokens, width) cos is {3: -1},
    Mochi's (tokens, heads, r) {3: 1}. A tensor of another rank, or of size 1 there, is left whole."""

    module: str
    arguments: tuple[str, ...]
    heads_dim: Mapping[int, int]


@dataclass(frozen=True)
class TensorPlan:
    """What tensor parallelism splits in a family's transformer, as data for the generic engine
    (accel/parallel/tensor.py).

    `layers` maps module patterns ("transformer_blocks.*.attn.to_q"; `*` is one list index) to a
    style: "colwise" keeps each rank's slice of the output features (Q, K, V, an MLP's input),
    "rowwise" each rank's slice of the input features, the partial outputs summed over the TP
    group (an attention's output projection, an MLP's output), or `Packed` for fused layers. A
    pattern matching no module in some block is skipped there (SD3's last block has no context
    MLP). `from_diffusers`: the layers are the transformer class's own `_tp_plan`, read when
    applied. `norms` are RMSNorms over a column-split width (Wan's and LTX's query/key norms span
    all heads): each rank keeps its slice of the weight and the mean square is summed over the
    group. `per_rank` names module attributes that count heads (or widths) a processor reshapes
    by (`attn.heads`), which become the rank's own count on every module holding a column-wise layer.
    `rotary` lists keyword arguments holding rotary embeddings that span all heads (see Rotary).
    """

    layers: Mapping[str, str | Packed] = field(default_factory=dict)
    from_diffusers: bool = False
    norms: tuple[str, ...] = ()
    per_rank: tuple[str, ...] = ()
    rotary: tuple[Rotary, ...] = ()


# The layers of the usual diffusers attention and MLP, for TensorPlan.layers: projections into the
# heads (and a joint attention's text-stream ones) column-wise, the output projections row-wise.
SELF_ATTENTION = (("to_q", "to_k", "to_v"), ("to_out.0",))
JOINT_ATTENTION = (("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"), ("to_out.0", "to_add_out"))
DIFFUSERS_MLP = (("net.0.proj",), ("net.2",))


def split_layers(prefix: str, layers: tuple[tuple[str, ...], tuple[str, ...]]) -> dict[str, str]:
    """TensorPlan.layers for one module: `layers` is (column-wise names, row-wise names) under `prefix`."""
    columns, rows = layers
    return {**{f"{prefix}.{name}": "colwise" for name in columns}, **{f"{prefix}.{name}": "rowwise" for name in rows}}


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
class NamedInput:
    """An input file a variant's call takes under a keyword of its own, which `--input KEYWORD=PATH`
    (`[generate] inputs`) fills: Wan Animate's pose and face videos, CogVideoX Fun's control video.
    The call receives a "video" as a list of RGB PIL frames, an "image" as one RGB PIL image.
    `when` = (argument, value) makes a required input required only for calls with that argument
    (Animate's background video, needed when `mode` is "replace").

    A "latents" input is the latent output an earlier pass saved (`--out NAME.pt` on a variant with
    `latent_output`), for a multi-pass workflow: `fields` says which saved output field goes to which
    call keyword, `made_by` names the pipelines whose output it takes (for the error a wrong file
    gets), and `settings` gives the call keywords the fields fix (the size of the canvas they hold),
    which accel passes and a recipe may not contradict."""

    keyword: str
    kind: Literal["image", "video", "latents"]
    required: bool = True
    when: tuple[str, Any] | None = None
    fields: tuple[tuple[str, str], ...] = ()
    made_by: tuple[str, ...] = ()
    settings: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class Component:
    """A component a variant's pipeline needs that the family's checkpoints do not hold: `name` is its
    keyword in the pipeline, `cls` its class (a dotted path), loaded with `from_pretrained` from the
    folder `[model] components` (`--component NAME=FOLDER`) names. `build` makes it without weights
    instead (a scheduler of another class), so no folder is needed. The variant's tiny builder makes
    every one of them itself; a folder given replaces its tiny one."""

    name: str
    cls: str
    build: Callable[[], Any] | None = None


@dataclass(frozen=True)
class Conditions:
    """How a variant takes pictures and clips pinned to positions in the video it makes
    (`--condition PATH@INDEX:STRENGTH`, `[generate] conditions`): the call gets a list under
    `keyword` of diffusers' `cls` objects (a dotted path), each built with the file (one RGB PIL
    image, or a clip as a list of them) under `frames` (under `video` for a clip where the class
    keeps the two apart), the position under `index` (None: the class has none, as IC-LoRA's
    reference videos, given as `--reference PATH@STRENGTH`), the strength under `strength`. `units`
    says what the index counts, for the help and errors; `tiny` are fields only the tiny variant's
    conditions get (LTX-2's `crf=0`, which skips a PyAV re-encode). `required`: a call needs at least
    one (LTX-2 HDR makes an HDR version of its reference clip; without one there is nothing to
    convert), refused in one line before start instead of a run of a video of nothing asked for.
    `sets_frames`: the first one, where it is a clip, gives the call its frame count unless `[generate]
    frames` says otherwise (HDR's output is the clip converted, frame for frame)."""

    cls: str
    units: str
    keyword: str = "conditions"
    frames: str = "frames"
    video: str | None = None
    index: str | None = "index"
    strength: str = "strength"
    tiny: tuple[tuple[str, Any], ...] = ()
    required: bool = False
    sets_frames: bool = False


@dataclass(frozen=True)
class Variant:
    """Another diffusers pipeline class that runs the family's transformer (img2img, inpaint, edit, …).

    `image`, `mask` and `video` are the call's keywords that `--image`, `--mask` and `--video` fill
    (None: the pipeline takes none; a video arrives as a list of PIL frames, as diffusers' video
    pipelines take it); each one named is required unless `optional` lists it ("image": FLUX.2's
    reference pictures). `one_of` names inputs of which a call takes at most one ("image", "mask",
    "video", "conditions": LTX's condition pipeline takes a picture, a clip or condition objects;
    given a picture and a clip, it would drop the clip). `in_list` names inputs the call takes
    inside a list, one item per condition (that pipeline reads `video` as a list of clips, and a
    bare list of frames as that many one-frame clips). `seed` is the call's own seed keyword, which
    accel gives the run's seed besides the generator (LTX's long multi-prompt pipeline seeds every
    temporal window's generator from it, 0 unless told). `mask_frames`: the mask is one per video
    frame (VACE), so `--mask` is a picture used for every frame of `--video`, or a video of masks.
    A family lists its own pipeline class here only to give it inputs. `area` is the keyword by which the pipeline
    rescales
    the size asked to a pixel budget (Kontext's `max_area`, 1024² by default): accel passes
    height x width there, so the size asked is the size made; `fixed` are keyword arguments every
    call gets, for the same reason (Kontext inpaint's `_auto_resize=False`). `tiny` builds the tiny variant where its
    transformer
    needs another config than the family's tiny one (FLUX.1 Fill reads 384 input channels); None:
    the family's tiny pipeline, converted with `from_pipe`. `transformer_class` names the variant's
    own transformer class where it has one (Wan VACE's sibling of WanTransformer3DModel, with the
    same blocks and extra ones): a pipeline holding it is this family, run under `parallel`, that
    class's plan (None: that class runs on one process, or with CFG parallelism alone). `inputs` are
    the call's other input files, each under its own keyword (`NamedInput`); `conditions` how it takes
    pictures and clips at chosen frames (`Conditions`), `references` its reference videos without a
    position (`--reference`).
    `not_split` says why sequence
    parallelism cannot cut this pipeline's transformer calls (its attention processors slice the whole
    sequence by position): Ulysses and Ring are then refused with that reason, every other
    accelerator still applies. `output` is what the pipeline makes where it differs from the
    family's (Kandinsky 5's text-to-image pipeline makes pictures with a video family's transformer):
    accel then writes that kind of file (OUTPUT_FILES) and passes a frame count only to videos; an
    "hdr-video" pipeline (LTX-2 HDR) is called with output_type "np" for its linear float32 frames,
    written as `--out X.npy` whole or `--out X.mp4` as an SDR preview; `vae` names its VAE class where it
    differs from the family's (its parallel decode: accel/models/vaes.py), and `defaults` the settings
    to start from where the family's do not fit it (None: the family's). `transformer_config` are
    (config key, value) pairs the variant's transformer must have (SkyReels-V1 image-to-video reads
    32 input channels): loading another checkpoint as this variant is refused in one line, not a
    shape error mid-run. `latent_output` are the fields of its output that `--out NAME.pt` saves
    (the call then returns latents, `output_type="latent"`), for a later pass's "latents" input
    (`NamedInput`); empty: it hands on no latents. `components` are the components it needs beyond
    the family's checkpoint (`Component`); `fps` the rate its videos play at, from the call's
    arguments, where it differs from the family's (DFR's refine round plays at twice its input's).
    """

    pipeline_class: str
    image: str | None = None
    mask: str | None = None
    video: str | None = None
    mask_frames: bool = False
    area: str | None = None
    fixed: tuple[tuple[str, Any], ...] = ()
    # Keyword arguments only the tiny variant's calls get: LTX-2 image-to-video's `image_crf=0` skips
    # the H.264 re-compression of the picture that matches the real model's training (and needs PyAV).
    tiny_fixed: tuple[tuple[str, Any], ...] = ()
    tiny: Callable[[], DiffusionPipeline] | None = None
    optional: tuple[str, ...] = ()
    one_of: tuple[str, ...] = ()
    in_list: tuple[str, ...] = ()
    seed: str | None = None
    inputs: tuple[NamedInput, ...] = ()
    conditions: Conditions | None = None
    references: Conditions | None = None
    # Call arguments the variant needs a value for, with the one accel gives unless `[generate]
    # arguments` (`--arg`) says otherwise: SkyReels-V2 video extension's `overlap_history`.
    arguments: tuple[tuple[str, Any], ...] = ()
    transformer_class: str | None = None
    parallel: ParallelPlan | FromDiffusers | None = None
    not_split: str | None = None
    output: OutputKind | None = None
    vae: str | None = None
    defaults: GenerationDefaults | None = None
    transformer_config: tuple[tuple[str, Any], ...] = ()
    latent_output: tuple[str, ...] = ()
    components: tuple[Component, ...] = ()
    fps: Callable[[Mapping[str, Any]], float] | None = None


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
    parallel: ParallelPlan | FromDiffusers | AutomaticPlan | None = None
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
    def parallel(self) -> ParallelPlan | FromDiffusers | AutomaticPlan | None:
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

    def plan_for(self, transformer: Any) -> ParallelPlan | FromDiffusers | AutomaticPlan | None:
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

"""The parallel plan format: what a family may say about splitting its transformer, as data.

Context parallelism (`ParallelPlan`, or `FromDiffusers` / `AutomaticPlan` to be resolved when
applied) and tensor parallelism (`TensorPlan`). Families under accel/models/ write these; the
engines in accel/parallel/ read them. Torch-free, so a family module imports it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


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
    simulated ranks before use (accel/parallel/choose.py): what a pipeline no family describes gets
    (its class's own `_cp_plan` tried first, its streams learned),
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


# A family's context-parallel plan as written: a plan, one derived from diffusers' `_cp_plan`, or the
# automatic one; the engine runs only a resolved ParallelPlan (accel/parallel/plan.py resolves it).
FamilyPlan = ParallelPlan | FromDiffusers | AutomaticPlan

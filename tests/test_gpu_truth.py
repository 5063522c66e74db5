"""GPU-true decisions made on the host, tested without a GPU: the local attention kernel, padded
key blocks cut rather than masked, the CFG placeholder, and each rank's own GPU under a launcher."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accel.errors import NotAvailableError, UserError
from accel.parallel import attention
from accel.parallel.attention import leading_real, usp_attention
from accel.parallel.cfg import Pending, placeholders_like
from accel.parallel.kernels import choose_kernel

ALL = frozenset({"flash", "cudnn", "efficient"})
BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "device,dtype,head_dim,masked,capability,enabled,expected",
    [
        ("cpu", torch.float32, 64, True, None, ALL, "cpu_flash"),
        ("cuda", BF16, 128, False, (9, 0), ALL, "cudnn"),  # Hopper: cuDNN's fused kernel
        ("cuda", BF16, 128, False, (8, 0), ALL, "flash"),  # Ampere: flash
        ("cuda", BF16, 128, False, None, ALL, "flash"),  # capability unknown (fake tensors)
        ("cuda", BF16, 256, False, (9, 0), ALL, "flash"),  # too wide for cuDNN, not for flash
        ("cuda", BF16, 512, False, (9, 0), ALL, "efficient"),  # too wide for flash
        ("cuda", BF16, 128, True, (9, 0), ALL, "efficient"),  # a mask: the masked kernel
        ("cuda", torch.float32, 128, False, (9, 0), ALL, "efficient"),  # flash and cuDNN are half-only
        ("cuda", BF16, 128, False, (9, 0), frozenset({"flash", "efficient"}), "flash"),  # sdpa_kernel without cuDNN
        ("cuda", BF16, 128, False, (9, 0), frozenset({"efficient"}), "efficient"),
        ("cuda", BF16, 128, False, (9, 0), frozenset(), "reference"),
        ("mps", BF16, 64, False, None, ALL, "reference"),
    ],
)
def test_kernel_choice(device, dtype, head_dim, masked, capability, enabled, expected) -> None:
    assert choose_kernel(device, dtype, head_dim, masked, capability, enabled) == expected


@pytest.mark.parametrize(
    "counts,sizes,expected",
    [
        ([4, 4], [4, 4], 8),
        ([4, 2], [4, 4], 6),  # padding at the end: a prefix
        ([4, 0, 0], [4, 4, 4], 4),
        ([0, 0], [4, 4], 0),
        ([2, 4], [4, 4], None),  # padding between two stretches (joint text + image streams)
        ([4, None], [4, 4], None),  # unknown: a model mask is data
    ],
)
def test_leading_real_keys(counts, sizes, expected) -> None:
    assert leading_real(counts, sizes) == expected


def test_padded_block_runs_unmasked_on_its_real_keys(monkeypatch) -> None:
    """5 key slots of which 3 are real: the kernel sees 3 keys and no mask, and the result equals
    attention over the real keys; with the hint missing, the mask is applied instead."""
    calls: list[tuple[int, bool]] = []
    kernel = attention.attention_with_lse

    def recording(q, k, v, bias=None, scale=None):
        calls.append((k.shape[-2], bias is not None))
        return kernel(q, k, v, bias, scale)

    monkeypatch.setattr(attention, "attention_with_lse", recording)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=generator) for _ in range(3))
    valid = (torch.arange(5) < 3).view(1, 1, 5)
    expected = F.scaled_dot_product_attention(q, k[:, :, :3], v[:, :, :3])
    cut = usp_attention(q, k, v, None, None, valid, None, [3])
    masked = usp_attention(q, k, v, None, None, valid)
    assert calls == [(3, False), (5, True)]
    torch.testing.assert_close(cut, expected)
    torch.testing.assert_close(masked, expected)


def test_cfg_placeholder_is_placed_and_filled_in_place() -> None:
    pending = Pending((2, 3), torch.bfloat16, torch.device("cpu"))
    assert pending.shape == (2, 3) and pending.dtype == torch.bfloat16  # reading its shape is fine
    held = pending  # what the pipeline keeps from the first call
    pending.fill(torch.arange(6, dtype=torch.bfloat16).view(2, 3))
    combined = held * 2 + 1
    assert type(combined) is torch.Tensor  # results are plain tensors once filled
    torch.testing.assert_close(combined, torch.arange(6, dtype=torch.bfloat16).view(2, 3) * 2 + 1)


def test_cfg_placeholder_of_unknown_shape_takes_the_result_shape() -> None:
    pending = Pending(None, torch.float32, torch.device("cpu"))
    pending.fill(torch.ones(4, 5))
    assert pending.shape == (4, 5) and float(pending.sum()) == 20.0


def test_using_the_first_branch_before_the_second_is_refused() -> None:
    """A pipeline that computes with branch 0's output before calling the transformer again would
    get a wrong image from any placeholder: it gets one line instead."""
    pending = Pending((2, 3), torch.float32, torch.device("cpu"))
    message = (
        "[parallel] cfg = 2: the pipeline used the first guidance branch's output before calling the "
        "transformer for the second, so the branches cannot run on separate ranks; set cfg = 1"
    )
    for use in (lambda p: p.float() * 2, lambda p: p[:, :1] * 2, lambda p: torch.cat([p, p])):
        with pytest.raises(NotAvailableError) as error:
            use(pending)
        assert str(error.value) == message


def test_a_deferring_placeholder_computes_what_was_asked_of_it_when_it_arrives() -> None:
    """A prediction whose family declares its structure (Cosmos 3 masks each branch's output right
    after the call): tensor operations give placeholders filled when their inputs arrive; what
    needs a value now (a bool, a number, an in-place write) is refused as for any placeholder."""
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    pending = Pending((2, 3), torch.float32, torch.device("cpu"), defers=True)
    masked = pending * mask
    other = Pending((2, 3), torch.float32, torch.device("cpu"), defers=True)
    combined = other + 2 * (masked.float() - other)  # two placeholders: computed when the last arrives
    assert isinstance(combined, Pending) and combined.shape == (2, 3)
    for use in (lambda p: bool(p.sum() > 0), lambda p: p.add_(1), lambda p: p.item()):
        with pytest.raises(NotAvailableError):
            use(pending)
    value, other_value = torch.arange(6.0).view(2, 3), torch.ones(2, 3)
    pending.fill(value)
    torch.testing.assert_close(masked, value * mask)
    assert not combined._ready
    other.fill(other_value)
    torch.testing.assert_close(combined, other_value + 2 * (value * mask - other_value))


def test_a_call_with_several_predictions_is_answered_with_one_placeholder_each() -> None:
    """Kandinsky 6 given audio latents predicts (video, audio), each shaped as its latents; without
    them the video's alone; an output dataclass (return_dict=True) has no names for the second."""
    from accel.models.kandinsky6 import predictions_like

    video, audio = torch.zeros(1, 2, 4, 4, 9), torch.zeros(1, 5, 4, dtype=torch.bfloat16)
    answer = placeholders_like(
        predictions_like, {"hidden_states": video, "audio_hidden_states": audio, "return_dict": False}
    )
    assert [(type(p), p.shape, p.dtype) for p in answer] == [
        (Pending, video.shape, video.dtype),
        (Pending, audio.shape, torch.bfloat16),
    ]
    assert len(placeholders_like(predictions_like, {"hidden_states": video, "return_dict": False})) == 1
    with pytest.raises(NotAvailableError) as refused:
        placeholders_like(predictions_like, {"hidden_states": video, "audio_hidden_states": audio})
    assert str(refused.value) == (
        "[parallel] cfg = 2: the transformer was called with return_dict=True and returns more than its "
        "sample, whose output fields accel cannot name for the other branch; set cfg = 1"
    )


@pytest.mark.parametrize("known", [True, False], ids=["shape known", "first step"])
def test_indexing_a_placeholder_gives_one_filled_with_it(known: bool) -> None:
    """Kontext keeps `out[:, :n]` of the first branch right after the call: a placeholder of the part."""
    pending = Pending((2, 5, 3) if known else None, torch.float32, torch.device("cpu"))
    part = pending[:, :2]
    assert isinstance(part, Pending) and (part.shape == (2, 2, 3) if known else True)
    value = torch.arange(30, dtype=torch.float32).view(2, 5, 3)
    pending.fill(value)
    torch.testing.assert_close(part * 1, value[:, :2])


def test_rank_device_under_a_launcher(monkeypatch) -> None:
    from accel.launch.environment import rank_device
    from accel.models.loading import resolve_device

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert rank_device("cuda") == "cuda" and rank_device("cpu") == "cpu"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("cuda") == "cuda:3" and rank_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve as a GPU node would
    assert resolve_device("cuda") == torch.device("cuda:3")
    assert resolve_device("auto") == torch.device("cuda:3")
    assert resolve_device("cpu") == torch.device("cpu")


def test_apply_refuses_a_pipeline_on_another_ranks_gpu(monkeypatch) -> None:
    from accel.apply_refusals import refuse_another_ranks_gpu

    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(UserError) as error:
        refuse_another_ranks_gpu(torch.device("cuda:0"))
    assert str(error.value) == (
        "accel.apply: the pipeline is on cuda:0, but this rank (LOCAL_RANK 1) runs on cuda:1; load it with "
        'accel.load_pipeline(..., device="cuda"), which picks the rank\'s GPU, or call pipe.to("cuda:1") before '
        "accel.apply"
    )
    refuse_another_ranks_gpu(torch.device("cuda:1"))
    refuse_another_ranks_gpu(torch.device("cpu"))


def test_a_restarted_process_group_gets_new_meshes() -> None:
    """Meshes are cached per job: after the group is destroyed and started again, the same layout
    must not hand back the destroyed groups."""
    from fakecuda import fake_rank

    from accel.parallel.mesh import Degrees, build_mesh

    with fake_rank(1, 2):
        first = build_mesh(Degrees(ulysses=2), "cuda")
        assert build_mesh(Degrees(ulysses=2), "cuda") is first
    with fake_rank(1, 2):
        second = build_mesh(Degrees(ulysses=2), "cuda")
    assert first is not None and second is not None and second is not first

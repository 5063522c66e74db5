"""Files no one can redirect, a full disk that loses nothing silently, and input no file or number
can turn into a traceback (issue 33, items 1, 5 and 6 on the CLI side)."""

from __future__ import annotations

import errno
import io
import os
import re
import struct
import subprocess
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from accel import preflight
from accel.cli import app
from accel.errors import RecipeError, UserError
from accel.files import claims, in_flight
from accel.files.claims import claim
from accel.files.exclusive_create import created
from accel.files.folders import fresh_folder
from accel.files.publish import Write, write_file, write_fresh
from accel.recipe import Recipe, load_recipe
from accel.recipe.limits import MAX_RECIPE_BYTES

runner = CliRunner()


def _cli(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), catch_exceptions=False)
    return result.exit_code, result.output


# --- symbolic links -------------------------------------------------------------------------


def test_a_lock_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    lock = tmp_path / ".a.png.accel-lock"
    lock.symlink_to(target)
    with pytest.raises(UserError) as refused:
        claim(tmp_path / "a.png")
    assert str(refused.value) == (
        f"{lock} is a symbolic link, not an accel lock; remove it (accel never follows a link there) and run again, "
        f"or choose another name than {tmp_path / 'a.png'}"
    )
    assert target.read_text() == "keep me" and lock.is_symlink()


def test_a_dangling_lock_symlink_creates_nothing_at_its_target(tmp_path: Path) -> None:
    (tmp_path / ".a.png.accel-lock").symlink_to(tmp_path / "created-by-link")
    with pytest.raises(UserError, match="is a symbolic link, not an accel lock"):
        claim(tmp_path / "a.png")
    assert not (tmp_path / "created-by-link").exists()


def test_run_refuses_a_planted_lock_link_before_loading(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / ".m.json.accel-lock").symlink_to(target)
    code, output = _cli(
        "run", "tiny-flux", "--steps", "1", "--out", str(tmp_path / "a.png"), "--json", str(tmp_path / "m.json")
    )
    assert code == 2 and "is a symbolic link, not an accel lock" in output and "Traceback" not in output
    assert target.read_text() == "keep me" and not (tmp_path / "a.png").exists()


def test_a_temporary_name_taken_by_a_link_is_refused_and_its_target_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import itertools

    monkeypatch.setattr(in_flight, "serial", itertools.count(7))  # the name the next temporary takes
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    temp = tmp_path / f".a.png.accel-{os.getpid()}-7.tmp.png"
    temp.symlink_to(target)
    with pytest.raises(UserError) as refused:
        write_file(tmp_path / "a.png", lambda path: path.write_text("out"), replace=False)
    assert str(refused.value) == (
        f"{temp} is a symbolic link; remove it (accel never writes through a name it did not create) and run again"
    )
    assert target.read_text() == "keep me" and temp.is_symlink() and not (tmp_path / "a.png").exists()


@pytest.mark.parametrize("flag", ["--json", "--out"])
def test_a_dangling_output_link_is_refused_before_loading(tmp_path: Path, flag: str) -> None:
    link = tmp_path / ("m.json" if flag == "--json" else "a.png")
    link.symlink_to(tmp_path / "missing" / "file")
    check = preflight.check_json if flag == "--json" else preflight.check_out
    with pytest.raises(UserError) as refused:
        check(link, False)
    assert str(refused.value) == (
        f"{link} (a symbolic link to {tmp_path / 'missing' / 'file'}, which does not exist) already exists; "
        f"pass --overwrite to replace it or choose another {flag}"
    )


def test_an_unwritable_json_folder_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"^--json /proc/m\.json: cannot create files in /proc \("):
        preflight.check_json(Path("/proc/m.json"), False)


def test_a_bench_folder_that_is_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "report").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError) as refused:
        preflight.check_bench_folder(tmp_path / "report")
    assert str(refused.value) == (
        f"--out {tmp_path / 'report'} is a symbolic link (to {tmp_path / 'elsewhere'}); bench never writes through a "
        "link, "
        "give a new or empty folder"
    )


def _swapped_for_a_link(target: Path, write: Write) -> Write:
    """`write`, after someone swapped the temporary it was given for a link to `target`: the race
    between creating the temporary and opening it."""

    def swap_then_write(temp: Path) -> None:
        temp.unlink()
        temp.symlink_to(target)
        write(temp)

    return swap_then_write


@pytest.mark.parametrize("kind", ["image", "hdr-video"])
def test_a_link_swapped_in_after_the_temporary_was_created_is_not_written_through(tmp_path: Path, kind: str) -> None:
    """PIL and numpy write through the descriptor that created the temporary: the link's target is
    untouched, and the swapped name is not published."""
    from accel.media import output_writer

    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    out = tmp_path / "a.png"
    frames = np.zeros((1, 8, 8, 3) if kind == "hdr-video" else (8, 8, 3), dtype=np.float32)
    with pytest.raises(UserError) as refused:
        write_file(
            out,
            _swapped_for_a_link(target, output_writer(frames, kind, ".npy" if kind == "hdr-video" else ".png", 8)),
            replace=True,
        )
    assert re.fullmatch(
        rf"{re.escape(str(tmp_path))}/\.a\.png\.accel-\d+-\d+\.tmp\.png was replaced while accel wrote it "
        r"\(someone else writes this folder\); nothing was published: write to a folder only you can write",
        str(refused.value),
    )
    assert target.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["precious.txt"]


def test_the_wav_before_the_mux_is_written_through_its_descriptor(tmp_path: Path) -> None:
    from accel.media import Audio, _write_wav

    sound, target = tmp_path / "a.wav", tmp_path / "precious.txt"
    target.write_text("keep me")
    with created(sound):
        sound.unlink()
        sound.symlink_to(target)
        _write_wav(Audio(np.zeros((1, 800), dtype=np.float32), 8000), sound)
    assert target.read_text() == "keep me"


def test_a_writer_given_a_name_accel_did_not_create_creates_it_exclusively(tmp_path: Path) -> None:
    from accel.media import image_writer

    image_writer(np.zeros((8, 8, 3)))(tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes().startswith(b"\x89PNG")
    (tmp_path / "b.png").symlink_to(tmp_path / "a.png")
    with pytest.raises(UserError, match=r"b\.png is a symbolic link; remove it"):
        image_writer(np.zeros((8, 8, 3)))(tmp_path / "b.png")


# --- a full disk ----------------------------------------------------------------------------


def _full_in(folder: Path):  # type: ignore[no-untyped-def]
    """A writer that hits ENOSPC inside `folder` and writes everywhere else."""

    def write(path: Path) -> None:
        if path.parent == folder:
            with open(path, "wb") as file:
                file.write(b"par")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        path.write_bytes(b"result")

    return write


@pytest.mark.parametrize("fresh", [False, True])
def test_enospc_saves_the_result_elsewhere_and_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: bool
) -> None:
    monkeypatch.setattr(in_flight, "closing", threading.Event())  # an earlier test may have run discard_temps
    out, spare = tmp_path / "out", tmp_path / "spare"
    out.mkdir()
    spare.mkdir()
    with claim(out / "a.png") as held, pytest.raises(UserError) as refused:
        if fresh:
            write_fresh(out, "a", ".png", _full_in(out), rescue=spare)
        else:
            write_file(out / "a.png", _full_in(out), replace=False, rescue=spare)
    (rescued,) = spare.glob("accel-rescued-*/a.png")
    assert (
        str(refused.value)
        == f"cannot write {out / 'a.png'} (no space left on device); the result was saved to {rescued} instead"
    )
    assert rescued.read_bytes() == b"result"
    assert not held.held and os.listdir(out) == []  # no temporary, no lock


def test_enospc_everywhere_says_the_result_is_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(in_flight, "closing", threading.Event())

    def full(path: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(UserError) as refused:
        write_file(tmp_path / "a.png", full, replace=True, rescue=tmp_path)
    assert str(refused.value) == (
        f"cannot write {tmp_path / 'a.png'} (no space left on device), nor a copy in {tmp_path} (no space left on "
        "device); "
        "the result is lost: free space or choose another folder"
    )


def test_enospc_writing_the_lock_leaves_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(claims.os, "pwrite", full)
    with pytest.raises(UserError) as refused:
        claim(tmp_path / "a.png")
    assert str(refused.value) == (
        f"cannot write the lock {tmp_path / '.a.png.accel-lock'} (no space left on device); free space or choose "
        "another name"
    )
    assert os.listdir(tmp_path) == []


def test_a_bench_folder_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "outputs").write_text("a file where the folder goes")
    with pytest.raises(UserError) as refused:
        fresh_folder(tmp_path / "outputs", "bench-tiny")
    assert (
        str(refused.value) == f"cannot create the folder {tmp_path / 'outputs'} (file exists); free space or pass --out"
    )


def test_a_bench_folder_denied_is_one_line_and_leaves_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EACCES on the folder's mkdir (faked: root may write anywhere): one line naming the folder; the
    claim taken just before gives its lock up."""
    from accel.bench.run import _claim_folder

    folder, mkdir = tmp_path / "report", Path.mkdir

    def denied(self: Path, *args: object, **kwargs: object) -> None:
        if self == folder:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(UserError) as refused:
        _claim_folder(folder)
    assert (
        str(refused.value)
        == f"cannot create the folder {folder} (permission denied); pass --out with a folder you may write"
    )
    assert os.listdir(tmp_path) == []


@contextmanager
def _small_tmpfs(mount: Path, options: str, covered_by: str) -> Iterator[Path]:
    """A tmpfs mounted at `mount` with `options`, where this process may mount (root in a private
    mount namespace is not needed: root is); elsewhere the test is skipped, naming the test that
    covers its path without a mount."""
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here ({made.stderr.decode().strip() or 'mount failed'}); {covered_by} covers "
            "the path"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """64 KiB and 2 inodes: its root's and one more."""
    with _small_tmpfs(
        tmp_path / "small", "size=64k,nr_inodes=2", "test_a_bench_folder_denied_is_one_line_and_leaves_no_lock"
    ) as mount:
        yield mount


def test_a_bench_folder_on_a_full_tmpfs_is_one_line_and_leaves_no_lock(tiny_tmpfs: Path) -> None:
    """The lock takes the last inode, the folder finds none: ENOSPC from the kernel, not a traceback."""
    from accel.bench.run import _claim_folder

    folder = tiny_tmpfs / "report"
    with pytest.raises(UserError) as refused:
        _claim_folder(folder)
    assert (
        str(refused.value) == f"cannot create the folder {folder} (no space left on device); free space or pass --out"
    )
    assert os.listdir(tiny_tmpfs) == []


def test_accel_bench_on_a_full_tmpfs_exits_2_in_one_line(tiny_tmpfs: Path, tmp_path: Path) -> None:
    """Refused when rank 0 claims the folder, before the model loads."""
    folder, recipe = tiny_tmpfs / "report", tmp_path / "bench.toml"
    recipe.write_text('[model]\nname = "tiny-flux"\n\n[bench]\nvariants = [{name = "plain"}]\n')
    code, output = _cli("bench", str(recipe), "--gpus", "1", "--out", str(folder))
    assert (code, output) == (
        2,
        f"error: cannot create the folder {folder} (no space left on device); free space or pass --out\n",
    )
    assert os.listdir(tiny_tmpfs) == []


def test_enospc_on_a_real_full_tmpfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(in_flight, "closing", threading.Event())
    with _small_tmpfs(tmp_path / "small", "size=64k", "test_enospc_saves_the_result_elsewhere_and_says_where") as mount:
        with pytest.raises(UserError) as refused:
            write_file(mount / "a.bin", lambda path: path.write_bytes(b"x" * 200_000), replace=False, rescue=tmp_path)
        (rescued,) = tmp_path.glob("accel-rescued-*/a.bin")
        assert str(refused.value).endswith(f"(no space left on device); the result was saved to {rescued} instead")
        assert rescued.stat().st_size == 200_000 and os.listdir(mount) == []


# --- caps on what the CLI reads -------------------------------------------------------------


def test_recipe_dev_zero_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as refused:
        load_recipe("/dev/zero")
    assert (
        str(refused.value)
        == "/dev/zero: a device, not a recipe file; pass a .toml recipe or an accel run --json report"
    )


def test_a_recipe_past_the_cap_is_refused_after_reading_one_byte_more(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    with open(big, "wb") as file:
        file.truncate(MAX_RECIPE_BYTES + 10)  # sparse: costs no disk
    with pytest.raises(RecipeError) as refused:
        load_recipe(big)
    assert (
        str(refused.value)
        == f"{big}: larger than 8 MiB; a recipe is a few kilobytes, pass a .toml recipe or an accel run --json report"
    )


def test_a_10mb_prompt_in_a_recipe_is_refused_in_one_line_before_loading(tmp_path: Path) -> None:
    recipe = tmp_path / "long.toml"
    recipe.write_text('[model]\nname = "tiny-flux"\n[generate]\nprompt = "' + "a" * 5_000_000 + '"\n')
    code, output = _cli("run", "--recipe", str(recipe), "--out", str(tmp_path / "a.png"))
    assert code == 2 and output.strip() == (
        f"error: {recipe}: [generate] prompt must be a string of at most 20,000 characters "
        "(ACCEL_MAX_PROMPT_CHARS raises the limit), got 5,000,000 characters"
    )
    assert os.listdir(tmp_path) == ["long.toml"]
    recipe.write_text('[generate]\nprompt = "' + "a" * 10_000_000 + '"\n')  # 10 MB: past the file's own cap
    code, output = _cli("run", "--recipe", str(recipe), "--out", str(tmp_path / "a.png"))
    assert code == 2 and output.strip() == (
        f"error: {recipe}: larger than 8 MiB; a recipe is a few kilobytes, pass a .toml recipe or an accel run --json "
        "report"
    )


def test_the_prompt_limit_applies_on_the_command_line_and_the_env_raises_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        RecipeError, match=r"negative_prompt must be a string of at most 20,000 characters .* got 20,001 characters$"
    ):
        Recipe.from_dict({"generate": {"negative_prompt": "n" * 20_001}})
    monkeypatch.setenv("ACCEL_MAX_PROMPT_CHARS", "30000")
    assert Recipe.from_dict({"generate": {"prompt": "p" * 20_001}}).generate.prompt == "p" * 20_001
    monkeypatch.setenv("ACCEL_MAX_PROMPT_CHARS", "lots")
    with pytest.raises(RecipeError) as refused:
        Recipe.from_dict({"generate": {"prompt": "p"}})
    assert str(refused.value) == "ACCEL_MAX_PROMPT_CHARS=lots: must be a positive integer (characters), e.g. 20000"


def test_a_tune_prompts_file_is_capped(tmp_path: Path) -> None:
    from accel.cli.tune import _read_prompts

    with pytest.raises(UserError) as refused:
        _read_prompts(Path("/dev/zero"))
    assert str(refused.value) == "--prompts /dev/zero: larger than 8 MiB; write one prompt a line"
    long = tmp_path / "prompts.txt"
    long.write_text("a fox\n" + "b" * 20_001 + "\n")
    with pytest.raises(UserError) as refused:
        _read_prompts(long)
    assert str(refused.value) == (
        f"--prompts {long}: prompt 2 has 20,001 characters, more than 20,000; shorten it (ACCEL_MAX_PROMPT_CHARS "
        "raises the limit)"
    )


def test_a_recipe_number_of_5000_digits_is_one_line(tmp_path: Path) -> None:
    recipe = tmp_path / "digits.toml"
    recipe.write_text("[generate]\nheight = " + "1" * 5000 + "\n")
    with pytest.raises(RecipeError, match=rf"^{recipe}: not valid TOML: Exceeds the limit \(4300 digits\)"):
        load_recipe(recipe)


# --- numbers that overflow ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        (
            "--guidance",
            "1e308",
            "[generate] guidance_scale must be a number >= 0, got 1e+308 (past float32's range, 3.4e+38, "
            "which pipelines compute in)",
        ),
        (
            "--true-cfg",
            "1e39",
            "[generate] true_cfg_scale must be a number >= 1, got 1e+39 (past float32's range, 3.4e+38, "
            "which pipelines compute in)",
        ),
        (
            "--seed",
            "99999999999999999999999",
            "[generate] seed must be an integer from 0 to 18446744073709551615, got 99999999999999999999999",
        ),
        (
            "--steps",
            "99999999999999999999",
            "[generate] steps must be an integer from 1 to 10000, got 99999999999999999999",
        ),
        (
            "--height",
            "99999999999999999984",
            "[generate] height must be an integer from 16 to 65536, got 99999999999999999984",
        ),
        ("--frames", "100001", "[generate] frames must be an integer from 1 to 100000, got 100001"),
    ],
)
def test_numbers_that_overflow_are_one_line_naming_the_option(
    tmp_path: Path, flag: str, value: str, message: str
) -> None:
    code, output = _cli("run", "tiny-flux", flag, value, "--out", str(tmp_path / "a.png"))
    assert code == 2 and output.strip() == f"error: command line: {message}"
    assert os.listdir(tmp_path) == []


def test_an_arg_of_5000_digits_stays_a_string() -> None:
    from accel.cli.options import pairs

    assert pairs("--arg", ["n=" + "9" * 5000], "overlap_history=17", parse=True) == {"n": "9" * 5000}


# --- decompression bombs --------------------------------------------------------------------


def _bomb(path: Path, side: int = 100_000) -> Path:
    """A valid PNG header claiming side × side pixels (a few bytes on disk)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (1, 1)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    at = data.index(b"IHDR")
    data[at + 4 : at + 12] = struct.pack(">II", side, side)
    data[at + 17 : at + 21] = struct.pack(">I", zlib.crc32(bytes(data[at : at + 17])))
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    "side", [100_000, 10_000]
)  # past Pillow's error limit, and between its warning and error limits
def test_a_decompression_bomb_image_is_one_line(tmp_path: Path, side: int) -> None:
    from accel.models.input_checks import _picture_or_clip, _readable_image

    bomb = _bomb(tmp_path / "bomb.png", side)
    message = (
        f"[generate] image: {bomb} has more than 89,478,485 pixels (Pillow's decompression-bomb limit); pass a "
        "smaller image"
    )
    with pytest.raises(UserError) as refused:
        _readable_image("image", str(bomb))
    assert str(refused.value) == message
    with pytest.raises(UserError) as refused:
        _picture_or_clip("image", str(bomb))
    assert str(refused.value) == message

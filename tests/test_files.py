"""Output files appear whole or not at all, and two runs never both get one name (accel.files)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from accel.errors import UserError
from accel.files import in_flight
from accel.files.claims import claim
from accel.files.cleanup import discard_temps, remove_listed_temps
from accel.files.folders import fresh_folder
from accel.files.in_flight import JOB_DIR_ENV
from accel.files.publish import write_file, write_fresh
from accel.media import read_video, save_image, save_video

ROOT = Path(__file__).resolve().parents[1]

# The child writes into argv[1] and touches argv[2] once it is paused mid-write.
PRELUDE = """
import sys, time
from pathlib import Path
folder, marker = Path(sys.argv[1]), Path(sys.argv[2])
def pause():
    marker.touch()
    time.sleep(60)
"""


def _paused_child(tmp_path: Path, body: str, job_dir: Path | None = None) -> subprocess.Popen[bytes]:
    """A bare python (no torch) running `body`, returned once it has paused mid-write."""
    env = {k: v for k, v in os.environ.items() if k != JOB_DIR_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if job_dir is not None:  # the launcher's job folder
        job_dir.mkdir(exist_ok=True)
        env[JOB_DIR_ENV] = str(job_dir)
    marker = tmp_path / "paused"
    child = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(tmp_path / "out"), str(marker)],
        env=env,
    )
    deadline = time.monotonic() + 20
    while not marker.exists():
        assert child.poll() is None, f"child exited with {child.returncode} before pausing"
        assert time.monotonic() < deadline, "child never paused"
        time.sleep(0.01)
    return child


def _kill(child: subprocess.Popen[bytes]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=10)


@pytest.mark.parametrize("replace", [False, True])
def test_a_kill_mid_write_leaves_no_file_and_the_launcher_removes_the_rest(tmp_path: Path, replace: bool) -> None:
    out, job = tmp_path / "out", tmp_path / "job"
    out.mkdir()
    if replace:
        (out / "r.bin").write_bytes(b"old")
    child = _paused_child(
        tmp_path,
        f"""
        from accel.files.claims import claim
        from accel.files.publish import write_file
        def write(temp):
            with open(temp, "wb") as f:
                f.write(b"x" * 1000)
            pause()
        with claim(folder / "r.bin"):
            write_file(folder / "r.bin", write, replace={replace})
    """,
        job,
    )
    _kill(child)
    if replace:  # the old file stays whole until the new one is complete
        assert (out / "r.bin").read_bytes() == b"old"
    else:
        assert not (out / "r.bin").exists()
    temps = list(out.glob(".r.bin.accel-*.tmp.bin"))
    assert len(temps) == 1 and temps[0].stat().st_size == 1000  # hidden; a SIGKILL runs no cleanup
    assert (out / ".r.bin.accel-lock").exists()
    remove_listed_temps(job)
    assert sorted(os.listdir(out)) == (["r.bin"] if replace else [])


def test_a_kill_while_pil_writes_leaves_no_png(tmp_path: Path) -> None:
    child = _paused_child(
        tmp_path,
        """
        import io
        import numpy as np
        from PIL import Image
        from accel.media import save_image
        original = Image.Image.save
        def save(self, fp, *args, **kwargs):
            whole = io.BytesIO()
            original(self, whole, "PNG")
            fp.write(whole.getvalue()[: len(whole.getvalue()) // 2])  # the file object accel opened
            fp.flush()
            pause()
        Image.Image.save = save
        save_image(np.zeros((16, 16, 3)), folder / "a.png")
    """,
        tmp_path / "job",
    )
    _kill(child)
    out = tmp_path / "out"
    assert not (out / "a.png").exists()
    assert [p.name for p in out.iterdir()] != []  # the half PNG is there, under its hidden name
    remove_listed_temps(tmp_path / "job")
    assert os.listdir(out) == []


def test_a_kill_while_ffmpeg_writes_leaves_no_mp4(tmp_path: Path) -> None:
    child = _paused_child(
        tmp_path,
        """
        import imageio_ffmpeg
        import numpy as np
        from accel.media import save_video
        original = imageio_ffmpeg.write_frames
        def write_frames(path, *args, **kwargs):
            frames = original(path, *args, **kwargs)
            class Pausing:
                sent = 0
                def send(self, frame):
                    frames.send(frame)
                    self.sent += frame is not None
                    if self.sent == 3:  # three of eight frames in
                        pause()
                def close(self):
                    frames.close()
            return Pausing()
        imageio_ffmpeg.write_frames = write_frames
        save_video(np.random.default_rng(0).random((8, 16, 16, 3)), folder / "v.mp4", fps=8)
    """,
        tmp_path / "job",
    )
    ffmpeg = _children(child.pid)
    _kill(child)
    _wait_gone(ffmpeg)  # ffmpeg, its input cut, finishes the temporary and exits
    out = tmp_path / "out"
    assert not (out / "v.mp4").exists()
    assert len(list(out.glob(".v.mp4.accel-*.tmp.mp4"))) == 1
    remove_listed_temps(tmp_path / "job")
    assert os.listdir(out) == []


def test_media_writes_whole_files_and_refuses_to_overwrite(tmp_path: Path) -> None:
    image = np.random.default_rng(0).random((6, 10, 3))
    assert save_image(image, tmp_path / "a.png") == tmp_path / "a.png"
    assert np.asarray(Image.open(tmp_path / "a.png")).shape == (6, 10, 3)
    with pytest.raises(UserError) as refused:
        save_image(image, tmp_path / "a.png")
    assert (
        str(refused.value)
        == f"{tmp_path / 'a.png'} already exists; choose another name or pass --overwrite to replace it"
    )
    save_image(np.zeros((4, 4, 3)), tmp_path / "a.png", replace=True)
    assert Image.open(tmp_path / "a.png").size == (4, 4)
    save_video(np.random.default_rng(0).random((3, 8, 8, 3)), tmp_path / "v.mp4", fps=4)
    assert read_video(tmp_path / "v.mp4").shape == (3, 8, 8, 3)
    assert sorted(os.listdir(tmp_path)) == ["a.png", "v.mp4"]


def test_an_interrupt_mid_write_removes_the_temporary(tmp_path: Path) -> None:
    def write(temp: Path) -> None:
        temp.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_file(tmp_path / "a.png", write, replace=True)
    with pytest.raises(KeyboardInterrupt):
        write_fresh(tmp_path, "b", ".png", write)
    assert os.listdir(tmp_path) == [] and not in_flight.temps


def test_the_second_of_two_writers_is_refused_and_the_first_result_kept(tmp_path: Path) -> None:
    path = tmp_path / "m.json"

    def slow(temp: Path) -> None:  # while this run writes, another one publishes first
        temp.write_text("second")
        write_file(path, lambda t: t.write_text("first"), replace=False)

    with pytest.raises(UserError) as refused:
        write_file(path, slow, replace=False)
    assert str(refused.value) == (
        f"{path} already exists (another run wrote it first); choose another name or pass --overwrite to replace it"
    )
    assert path.read_text() == "first" and os.listdir(tmp_path) == ["m.json"]
    with pytest.raises(UserError) as refused:
        write_file(path, slow, replace=False, hint="bench never overwrites, choose another name")
    assert str(refused.value) == f"{path} already exists; bench never overwrites, choose another name"


def test_concurrent_writers_to_one_path_exactly_one_wins(tmp_path: Path) -> None:
    path, start = tmp_path / "a.txt", threading.Barrier(8)
    outcomes: list[str] = []

    def writer(index: int) -> None:
        def write(temp: Path) -> None:
            temp.write_text(str(index))
            start.wait()  # all have written before any publishes

        try:
            write_file(path, write, replace=False)
            outcomes.append(f"won {index}")
        except UserError:
            outcomes.append("refused")

    _together(writer, 8)
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1 and outcomes.count("refused") == 7
    assert path.read_text() == winners[0].split()[1] and os.listdir(tmp_path) == ["a.txt"]


def test_a_folder_is_refused_with_or_without_replace(tmp_path: Path) -> None:
    folder = tmp_path / "x.png"
    folder.mkdir()
    for replace in (False, True):
        with pytest.raises(UserError) as refused:
            write_file(folder, lambda temp: pytest.fail("wrote although the name is a folder"), replace=replace)
        assert str(refused.value) == f"{folder} is a folder, not a file; choose a file name"
    assert os.listdir(tmp_path) == ["x.png"] and os.listdir(folder) == []


def test_write_fresh_never_gives_two_writers_one_name(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_text("taken")
    (tmp_path / "a-1.png").mkdir()
    start = threading.Barrier(8)
    chosen: list[Path] = []

    def writer(index: int) -> None:
        start.wait()
        for round_ in range(5):
            chosen.append(write_fresh(tmp_path, "a", ".png", lambda temp: temp.write_text(f"{index}.{round_}")))

    _together(writer, 8)
    assert len(set(chosen)) == 40
    assert {p.name for p in chosen} == {f"a-{n}.png" for n in range(2, 42)}
    assert sorted(p.read_text() for p in chosen) == sorted(f"{i}.{r}" for i in range(8) for r in range(5))
    assert (tmp_path / "a.png").read_text() == "taken" and len(os.listdir(tmp_path)) == 42


def test_fresh_folder_creates_each_folder_for_one_caller(tmp_path: Path) -> None:
    (tmp_path / "bench-r").write_text("a file")
    (tmp_path / "bench-r-1").mkdir()
    (tmp_path / "bench-r-1" / "keep").write_text("mine")
    start = threading.Barrier(6)
    made: list[Path] = []

    def maker(_index: int) -> None:
        start.wait()
        made.append(fresh_folder(tmp_path, "bench-r"))

    _together(maker, 6)
    assert sorted(p.name for p in made) == [f"bench-r-{n}" for n in range(2, 8)]
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)
    assert fresh_folder(tmp_path / "new", "b") == tmp_path / "new" / "b"


def test_a_claim_refuses_a_second_claimer_until_released(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    with claim(path) as held:
        assert (tmp_path / ".a.png.accel-lock").read_text() == f"{os.getpid()}\n"
        with pytest.raises(UserError) as refused:
            claim(path)
        assert str(refused.value) == (
            f"{path} is being written by another accel run (pid {os.getpid()}); choose another name or wait for it"
        )
    assert not held.held and os.listdir(tmp_path) == []
    held.release()  # idempotent
    claim(path).release()


def test_a_claim_held_by_another_process_is_refused_and_taken_over_when_it_dies(tmp_path: Path) -> None:
    child = _paused_child(
        tmp_path,
        """
        from accel.files.claims import claim
        held = claim(folder / "a.png")
        pause()
    """,
    )
    path = tmp_path / "out" / "a.png"
    with pytest.raises(UserError) as refused:
        claim(path)
    assert str(refused.value) == (
        f"{path} is being written by another accel run (pid {child.pid}); choose another name or wait for it"
    )
    _kill(child)
    with claim(path):  # a dead run's lock is stale
        assert (tmp_path / "out" / ".a.png.accel-lock").read_text() == f"{os.getpid()}\n"
    assert os.listdir(tmp_path / "out") == []


def test_a_stale_lock_naming_a_dead_pid_is_taken_over(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = tmp_path / ".a.png.accel-lock"
    lock.write_text(done.stdout)
    with claim(tmp_path / "a.png"):
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not lock.exists()


def test_discard_temps_removes_unfinished_files_and_claims(tmp_path: Path) -> None:
    held = claim(tmp_path / "a.png")
    seen: list[Path] = []

    def write(temp: Path) -> None:  # the watchdog fires while the main thread writes
        temp.write_bytes(b"half")
        seen.append(temp)
        discard_temps()

    with pytest.raises(FileNotFoundError):
        write_file(tmp_path / "a.png", write, replace=False)
    assert seen and not seen[0].exists() and not held.held and os.listdir(tmp_path) == []


def test_remove_listed_temps_leaves_a_live_claim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = tmp_path / "job"
    job.mkdir()
    monkeypatch.setenv(JOB_DIR_ENV, str(job))
    with claim(tmp_path / "a.png"):
        write_file(tmp_path / "b.png", lambda temp: temp.write_text("b"), replace=False)
        listed = (job / f"temps-{os.getpid()}.txt").read_text().splitlines()
        assert str(tmp_path / ".a.png.accel-lock") in listed and len(listed) == 2
        remove_listed_temps(job)
        assert (tmp_path / ".a.png.accel-lock").exists() and (tmp_path / "b.png").read_text() == "b"


def test_run_refuses_an_out_another_run_is_writing_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accel import runner
    from accel.recipe import Recipe

    monkeypatch.setattr(runner, "load_pipeline", lambda *args, **kwargs: pytest.fail("loaded despite the claim"))
    out = tmp_path / "a.png"
    with claim(out):
        with pytest.raises(UserError) as refused:
            runner.run(Recipe.from_dict({"model": {"name": "tiny-flux"}}), out=out)
    assert str(refused.value) == (
        f"{out} is being written by another accel run (pid {os.getpid()}); choose another name or wait for it"
    )
    assert os.listdir(tmp_path) == []


def test_a_bench_folder_is_claimed_and_must_still_be_empty(tmp_path: Path) -> None:
    from accel.bench.run import _claim_folder

    folder = tmp_path / "report"
    with _claim_folder(folder):
        assert folder.is_dir()
        with pytest.raises(UserError, match=r"report is being written by another accel run \(pid \d+\)"):
            _claim_folder(folder)
        (folder / "01-baseline.png").write_text("x")
    with pytest.raises(UserError) as refused:
        _claim_folder(folder)
    assert str(refused.value) == (
        f"--out {folder} is no longer empty (another run wrote into it); bench never overwrites, choose another"
    )
    assert sorted(os.listdir(tmp_path)) == ["report"]  # no lock left behind


def _children(pid: int) -> list[int]:
    """The processes `pid` started (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} still running"
        time.sleep(0.01)


def _together(target: Callable[[int], None], count: int) -> None:
    threads = [threading.Thread(target=target, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

"""`accel batch`'s parts without a model: the requests file (items, bad lines with their number),
shards, the manifest (a torn line, missing files, an edited line) and the retries, driven through
the server's own dispatcher with replicas that are plain functions."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from accel.batch.items import Item, read_items
from accel.batch.manifest import DONE, FAILED, Manifest, Record, Shard, read_records
from accel.batch.run import BatchOptions, Tally, _drive, default_seed, plan
from accel.models.registry import FAMILIES
from accel.serve.dispatch import Dispatcher
from accel.serve.replica import Outcome
from accel.serve.requests import Job, Served

FLUX = FAMILIES["flux"]
SERVED = Served("tiny-flux", FLUX, "image")

LINES = [
    '{"prompt": "a red fox", "size": "64x64", "seed": 3}',
    "",
    '{"custom_id": "boat", "prompt": "a boat", "n": 2}',
    "not json",
    "[1, 2]",
    '{"custom_id": "../etc", "prompt": "x"}',
    '{"custom_id": "boat", "prompt": "again"}',
    '{"custom_id": "city", "method": "POST", "url": "/v1/images/generations", "body": {"prompt": "a city"}}',
    '{"custom_id": "v", "url": "/v1/videos", "body": {"prompt": "a clip"}}',
    '{"custom_id": "w", "url": "/v1/embeddings", "body": {"prompt": "x"}}',
    '{"custom_id": "m", "method": "GET", "body": {"prompt": "x"}}',
    '{"custom_id": "e", "body": {"prompt": "x"}, "extra": 1}',
    '{"prompt": "x", "colour": "red"}',
    '{"prompt": "x", "size": "65x64"}',
    '{"prompt": ""}',
]


def _file(folder: Path, lines: list[str]) -> Path:
    path = folder / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_each_line_is_an_item_or_a_bad_line_with_its_number(tmp_path: Path) -> None:
    items, bad = read_items(_file(tmp_path, LINES))
    assert [(item.line, item.key, item.kind) for item in items] == [
        (1, "000001", None),
        (3, "boat", None),
        (8, "city", "image"),
        (9, "v", "video"),
        (13, "000013", None),
        (14, "000014", None),
        (15, "000015", None),
    ]
    assert items[2].body == {"prompt": "a city"} and items[1].body == {"prompt": "a boat", "n": 2}
    assert [str(line) for line in bad] == [
        "line 4: not JSON (Expecting value at column 1)",
        "line 5: a JSON object of the request's fields, not list",
        "line 6: custom_id: 1 to 100 letters, digits, '.', '_' or '-' (it names the output files), not '../etc'",
        "line 7: custom_id 'boat' is also line 3's; give each its own",
        "line 10: url: one of /v1/images/generations, /v1/videos, /v1/videos/generations, not '/v1/embeddings'",
        "line 11: method: only POST, not 'GET'",
        "line 12: extra: not a field of a batch line (custom_id, method, url, body)",
    ]
    # Knowing the output (before loading, from the registry), the fields are checked as the endpoint checks them.
    items, bad = read_items(_file(tmp_path, LINES), "image")
    assert [item.key for item in items] == ["000001", "boat", "city", "000014"]
    assert [str(line) for line in bad if line.line in (9, 13, 15)] == [
        "line 9: url asks for videos; this pipeline makes images",
        "line 13: colour: not a field of this endpoint",
        "line 15: prompt: String should have at least 1 character",
    ]
    assert len(bad) == 10


def test_a_size_the_model_does_not_make_is_a_bad_line_once_the_pipeline_is_known(tmp_path: Path) -> None:
    path = _file(tmp_path, LINES)
    tally = Tally()
    jobs = plan(BatchOptions(path, tmp_path / "out"), SERVED, 0, Manifest(tmp_path), tally)
    assert [item.key for item, _job in jobs] == ["000001", "boat", "city"]
    assert str(tally.bad[-2]) == "line 14: size: FLUX.1 makes widths in multiples of 16 pixels; use 64 or 80 (width 65)"
    assert len(tally.bad) == 11 and tally.total == 3
    fox, boat, city = (job for _item, job in jobs)
    assert fox == Job(1, "image", {"prompt": "a red fox", "width": 64, "height": 64, "seed": 3}, 1)
    # Without a seed, one from the line: the same on every rerun, n images apart from the next line's.
    assert boat.generate["seed"] == default_seed(0, jobs[1][0]) == 8 and boat.count == 2
    assert city.id == 8 and city.generate["seed"] == 28
    with pytest.raises(Exception) as refused:
        plan(BatchOptions(path, tmp_path / "out", strict=True), SERVED, 0, Manifest(tmp_path), Tally())
    assert str(refused.value) == (
        f"{path} line 4: not JSON (Expecting value at column 1) (and 10 more); fix the file, or run without "
        "--strict to skip such lines"
    )


def test_shards_split_the_lines_and_refuse_a_bad_spec(tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": f"p{k}"}) for k in range(7)]
    lines.insert(3, "")  # blank lines are not counted
    path = _file(tmp_path, lines)
    taken = []
    for index in range(3):
        jobs = plan(BatchOptions(path, tmp_path, shard=Shard(index, 3)), SERVED, 0, Manifest(tmp_path), Tally())
        taken.append([item.body["prompt"] for item, _job in jobs])
    assert taken == [["p0", "p3", "p6"], ["p1", "p4"], ["p2", "p5"]]
    for text, message in (
        ("2", "--shard: write I/N with 0 <= I < N (e.g. 0/4), not '2'"),
        ("1/0", "--shard: write I/N with 0 <= I < N (e.g. 0/4), not '1/0'"),
        ("-1/2", "--shard: write I/N with 0 <= I < N (e.g. 0/4), not '-1/2'"),
        ("2/2", "--shard 2/2: the index counts from 0, so it must be below 2"),
    ):
        with pytest.raises(ValueError) as refused:
            Shard.parse(text)
        assert str(refused.value) == message
    assert (
        Shard.parse("1/4").manifest == "manifest.shard-1-of-4.jsonl" and Shard.parse("0/1").manifest == "manifest.jsonl"
    )


def _item(folder: Path, key: str, line: int, prompt: str = "p") -> Item:
    """The item line `line` of a file holding that one request is."""
    path = folder / f"{key}.jsonl"
    path.write_text("\n" * (line - 1) + json.dumps({"custom_id": key, "prompt": prompt}) + "\n")
    return read_items(path)[0][0]


def test_the_manifest_knows_done_items_by_request_and_files_and_skips_a_torn_line(tmp_path: Path) -> None:
    src = tmp_path / "requests"
    src.mkdir()
    manifest = Manifest(tmp_path)
    fox = _item(src, "fox", 1)
    names = manifest.write_outputs(fox, ".png", [b"a", b"b"])
    assert names == ["fox_0.png", "fox_1.png"] and (tmp_path / "fox_1.png").read_bytes() == b"b"
    manifest.append(Record.of(fox, DONE, files=names, seeds=[1, 2], seconds=0.5))
    manifest.append(Record.of(_item(src, "cat", 2), FAILED, error="boom"))
    with (tmp_path / "manifest.jsonl").open("a") as torn:  # a killed run's last write
        torn.write('{"key": "dog", "line": 3, "dig')
    again = Manifest(tmp_path)
    cat = _item(src, "cat", 2)
    assert again.done(fox) and again.failures(cat) == 1 and not again.done(cat)
    assert set(read_records(tmp_path)) == {"fox", "cat"}
    record = json.loads((tmp_path / "manifest.jsonl").read_text().splitlines()[0])
    assert record["request"] == {"prompt": "p"} and record["files"] == names and record["seeds"] == [1, 2]
    assert not again.done(_item(src, "fox", 1, prompt="edited"))  # another request under the same name
    (tmp_path / "fox_1.png").unlink()
    assert not Manifest(tmp_path).done(fox)  # its files are part of being done


def test_an_unsharded_run_removes_what_a_killed_run_was_writing(tmp_path: Path) -> None:
    orphan = tmp_path / ".000003.png.accel-999999999-4.tmp.png"
    ours = tmp_path / f".000004.png.accel-{os.getpid()}-4.tmp.png"
    for path in (orphan, ours):
        path.write_bytes(b"half")
    Manifest(tmp_path, Shard(0, 2))  # another shard's run may own a temporary: left alone
    assert orphan.exists()
    Manifest(tmp_path)
    assert not orphan.exists() and ours.exists()


@contextmanager
def _count(total: int) -> Iterator[Any]:
    class Bar:
        ended: list[tuple[str, str | None]] = []

        def advance(self, key: str, error: str | None) -> None:
            self.ended.append((key, error))

    yield Bar()


def test_a_failed_item_is_tried_again_until_its_retries_are_spent_and_then_not_rerun(tmp_path: Path) -> None:
    lines = [json.dumps({"custom_id": key, "prompt": key, "seed": 1}) for key in ("ok", "flaky", "broken")]
    path = _file(tmp_path, lines)
    out = tmp_path / "out"
    out.mkdir()
    tries: list[str] = []

    def replica(job: Job) -> Outcome:
        if job.stop:
            return Outcome(True)
        prompt = job.generate["prompt"]
        tries.append(prompt)
        if prompt == "broken" or (prompt == "flaky" and tries.count("flaky") == 1):
            return Outcome(False, error=f"{prompt} failed")
        return Outcome(True, [prompt.encode()], [1], seconds=0.1)

    def run_once() -> Tally:
        options = BatchOptions(path, out, retries=2)
        manifest = Manifest(out)
        tally = Tally()
        jobs = plan(options, SERVED, 0, manifest, tally)
        dispatcher = Dispatcher([replica, replica], 4)
        dispatcher.start()
        try:
            _drive(dispatcher, jobs, ".png", options, manifest, tally, _count)
        finally:
            dispatcher.stop()
        return tally

    tally = run_once()
    assert sorted(tries) == ["broken"] * 3 + ["flaky"] * 2 + ["ok"]
    assert (tally.done, [item.key for item in tally.failed], tally.exit_code) == (2, ["broken"], 1)
    statuses = [(r["key"], r["status"], r["error"]) for r in map(json.loads, (out / "manifest.jsonl").open())]
    assert sorted(statuses) == sorted(
        [("ok", "done", None), ("flaky", "failed", "flaky failed"), ("flaky", "done", None)]
        + [("broken", "failed", "broken failed")] * 3
    )
    assert (out / "flaky.png").read_bytes() == b"flaky" and not (out / "broken.png").exists()
    tries.clear()
    again = run_once()  # a rerun: nothing left to try
    assert tries == [] and (again.already, len(again.failed), again.exit_code) == (2, 1, 1)


def test_a_rerun_with_another_model_or_settings_makes_its_items_again_and_more_gpus_resume(tmp_path: Path) -> None:
    """Done items are done for what made them: another model, seed, cache, quantization or LoRA file
    makes the same lines anew; a rerun on another layout (more GPUs, compile) skips them."""
    from accel.recipe import Recipe

    from accel.batch.run import what_makes

    path = _file(tmp_path, ['{"custom_id": "fox", "prompt": "a red fox"}'])
    out = tmp_path / "out"
    out.mkdir()
    base = Recipe.from_dict({"model": {"name": "tiny-flux"}})
    made_by = what_makes(base, {"pixel": "/loras/pixel.safetensors"})
    ((item, _job),) = plan(BatchOptions(path, out), SERVED, 0, Manifest(out), Tally(), made_by)
    manifest = Manifest(out)
    manifest.append(Record.of(item, DONE, files=manifest.write_outputs(item, ".png", [b"fox"])))

    def already(recipe: Recipe, loras: dict[str, str] | None = None) -> int:
        tally = Tally()
        plan(
            BatchOptions(path, out),
            SERVED,
            0,
            Manifest(out),
            tally,
            what_makes(recipe, loras or {"pixel": "/loras/pixel.safetensors"}),
        )
        return tally.already

    assert already(base) == 1
    for layout in ({"parallel": {"ulysses": 2}}, {"compile": {"enabled": True}}, {"vae": {"parallel": True}}):
        assert already(base.with_overrides(layout)) == 1, layout
    for other in (
        {"model": {"name": "tiny-sd3"}},
        {"generate": {"seed": 1}},
        {"generate": {"steps": 9}},
        {"cache": {"threshold": 0.1}},
        {"quant": {"type": "int8wo"}},
    ):
        assert already(base.with_overrides(other)) == 0, other
    assert already(base, {"pixel": "/loras/pixel-v2.safetensors"}) == 0

"""Input from where the data lives (jobs/inputs.py): Parquet, JSONL, directories and globs read as one table,
extra columns carried to the output, schemas unified across files and chunks, OpenAI batch files in and out."""
import gzip
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jobs.inputs
from engine import LLM, SamplingParams
from jobs import JobError
from jobs.generate import generate_job, open_input
from jobs.inputs import InputFiles, fingerprint_change

ROWS = [{"id": i, "prompt": f"prompt {i} " * (1 + i % 3), "tag": f"t{i}", "score": i * 1.5} for i in range(10)]


def job(path, keep_columns=None, **extra):
    return SimpleNamespace(input=str(path), prompt_column="prompt", id_column=None, keep_columns=keep_columns, **extra)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(make_config, directory: Path, *overrides) -> Path:
    directory.mkdir()
    generate_job(make_config(*overrides, "model.device=cpu", "model.max_model_len=256", "sampling.max_tokens=3"), directory)
    return directory


def test_jsonl_a_directory_and_a_glob_give_the_results_of_one_parquet_file(make_config, tmp_path, one_thread):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "all.parquet")
    write_jsonl(tmp_path / "all.jsonl", ROWS)
    (tmp_path / "dir" / "z-nested").mkdir(parents=True)
    for k, (lo, hi) in enumerate(((0, 4), (4, 7), (7, 10))):  # sorted by path: part-0, part-1, z-nested/part-2
        where = tmp_path / "dir" / ("z-nested" if k == 2 else "") / f"part-{k}.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS[lo:hi]), where)
    (tmp_path / "dir" / "_SUCCESS").write_text("")  # skipped, as are hidden files
    pq.write_table(pa.table({"unrelated": [1]}), tmp_path / "dir" / ".hidden.parquet")
    (tmp_path / "jsonl-dir").mkdir()
    write_jsonl(tmp_path / "jsonl-dir" / "a.jsonl", ROWS[:6]), write_jsonl(tmp_path / "jsonl-dir" / "b.jsonl", ROWS[6:])
    inputs = {"parquet": tmp_path / "all.parquet", "jsonl": tmp_path / "all.jsonl", "dir": tmp_path / "dir",
              "glob": f"{tmp_path}/dir/**/part-*.parquet", "jsonl dir": tmp_path / "jsonl-dir"}
    tables = {name: pq.read_table(run(make_config, tmp_path / f"run-{n}", f"job.input={spec}") / "generations.parquet")
              for n, (name, spec) in enumerate(inputs.items())}
    reference = tables.pop("parquet")
    assert reference.column_names[-2:] == ["tag", "score"]  # every other input column is carried
    assert reference.select(["id", "tag", "score"]).to_pylist() == [{k: r[k] for k in ("id", "tag", "score")} for r in ROWS]
    assert all(r["finish_reason"] == "length" and r["output_tokens"] == 3 for r in reference.to_pylist())
    for name, table in tables.items():
        assert table.equals(reference), name


def test_keep_columns_chooses_the_columns_carried(make_config, tmp_path, one_thread):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert open_input(job(path))[1].keep == ["tag", "score"]
    assert open_input(job(path, ["score"]))[1].keep == ["score"]
    assert open_input(job(path, []))[1].keep == []
    out = run(make_config, tmp_path / "run", f"job.input={path}", "job.keep_columns=[score]") / "generations.parquet"
    out = pq.read_table(out)
    assert out.column_names[-1] == "score" and "tag" not in out.column_names
    assert out["score"].to_pylist() == [r["score"] for r in ROWS]
    with pytest.raises(JobError, match=r"job.keep_columns: 'nope' is not an input column other than the id and prompt; "
                                       r"columns: \['tag', 'score'\]"):
        open_input(job(path, ["nope"]))
    clash = tmp_path / "clash.parquet"  # an input column named like a column of the output
    pq.write_table(pa.table({"prompt": ["a"], "error": ["x"], "tag": ["t"]}), clash)
    assert open_input(job(clash))[1].keep == ["tag"]
    with pytest.raises(JobError, match=r"job.keep_columns: 'error' is also a column of generations.parquet"):
        open_input(job(clash, ["error"]))
    with pytest.raises(JobError, match=r"^job.keep_columns: 'tag' is listed more than once$"):  # before any work
        open_input(job(path, ["tag", "score", "tag"]))


def test_jsonl_types_come_from_every_line_not_the_first_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs.inputs, "CHUNK_BYTES", 64)  # a few lines per chunk
    rows = [{"prompt": f"p{i}", "note": None, "n": i} for i in range(20)]
    rows += [{"prompt": "late", "note": "now text", "n": 2.5, "extra": True}]
    source = InputFiles(str(write_jsonl(tmp_path / "in.jsonl", rows)))
    assert source.num_rows == 21
    assert source.schema.field("note").type == pa.string() and source.schema.field("n").type == pa.float64()
    table = pa.Table.from_batches(list(source.batches(["prompt", "note", "n", "extra"], 8)))
    assert table.to_pylist() == [{"extra": None, **r} for r in rows[:-1]] + [rows[-1]]
    lines = [{"prompt": "a" * 80, "note": 1}, {"prompt": "b", "note": "one"}]  # the first line fills a chunk
    write_jsonl(tmp_path / "clash.jsonl", lines)  # a carried column: one type for the output's column
    with pytest.raises(JobError, match=r"the column types of .*clash.jsonl clash with the rows before it "
                                       r"\(.*Field note has incompatible types: int64 vs string\)"):
        InputFiles(str(tmp_path / "clash.jsonl"))
    monkeypatch.setattr(jobs.inputs, "CHUNK_BYTES", 1 << 20)  # the same clash inside one chunk
    with pytest.raises(JobError, match=r"clash.jsonl, lines 1-2: column 'note' holds both number and string values"):
        InputFiles(str(tmp_path / "clash.jsonl"))


def test_duplicate_column_names_are_reported_as_such(tmp_path):
    table = pa.Table.from_arrays([pa.array([1, 2]), pa.array(["a", "b"]), pa.array([3, 4])], ["id", "prompt", "id"])
    pq.write_table(table, tmp_path / "dup.parquet")
    with pytest.raises(JobError, match=r"job.input: .*dup.parquet has duplicate column names \['id'\]"):
        open_input(job(tmp_path / "dup.parquet"))
    (tmp_path / "dup.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b", "tag": 1, "tag": 2}\n')
    with pytest.raises(JobError, match=r"dup.jsonl, lines 1-2 has a duplicate column name: key 'tag' twice in one row"):
        open_input(job(tmp_path / "dup.jsonl"))


def test_inputs_that_name_no_usable_files(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "mixed").mkdir()
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "mixed" / "a.parquet")
    write_jsonl(tmp_path / "mixed" / "b.jsonl", [{"prompt": "b"}])
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    cases = {
        f"{tmp_path}/nothing-*.parquet": r"job.input: no file matches .*nothing-\*.parquet",
        str(tmp_path / "empty"): r"job.input: no \*.parquet or \*.jsonl file in directory .*empty",
        str(tmp_path / "mixed"): r"job.input: .*mixed mixes JSONL and Parquet files",
        str(tmp_path / "broken.jsonl"): r"job.input: .*broken.jsonl, line 2 is not a JSON object \(Expecting value: "
                                        r"line 1 column 12",
    }
    for spec, message in cases.items():
        with pytest.raises(JobError, match=message):
            open_input(job(spec))


@pytest.mark.parametrize("name", ["in.ndjson", "IN.JSONL", "in.NDJSON.gz"])
def test_ndjson_and_upper_case_names_are_jsonl(tmp_path, name):
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    opener = gzip.open if name.endswith(".gz") else open
    with opener(tmp_path / name, "wt") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows)
    source = InputFiles(str(tmp_path / name))
    assert source.format == "jsonl" and source.num_rows == 2
    assert pa.Table.from_batches(list(source.batches(["prompt"], 8))).to_pylist() == rows


def test_a_broken_line_deep_in_a_large_jsonl_is_named(tmp_path, monkeypatch):
    """The line's number in the file, counted by hand: chunks of a few lines each, blank lines among them."""
    monkeypatch.setattr(jobs.inputs, "CHUNK_BYTES", 64)
    lines = [json.dumps({"prompt": f"row {i}"}) if i % 7 else "" for i in range(1, 60)]
    lines[41] = '{"prompt": "cut'  # line 42
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(JobError, match=r"big.jsonl, line 42 is not a JSON object \(Unterminated string"):
        InputFiles(str(tmp_path / "big.jsonl"))
    lines[41] = "[1, 2]"
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(JobError, match=r"big.jsonl, line 42 is not a JSON object \(a JSON list\)"):
        InputFiles(str(tmp_path / "big.jsonl"))


def test_the_fingerprint_follows_the_bytes_not_the_timestamps(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), path)
    before = InputFiles(str(path)).fingerprint()
    os.utime(path, (1, 1))  # touched (or copied): the same bytes
    assert fingerprint_change(before, InputFiles(str(path)).fingerprint()) is None
    pq.write_table(pa.table({"prompt": ["a", "c"]}), path)
    assert fingerprint_change(before, InputFiles(str(path)).fingerprint()) == f"{path} changed (same size, other bytes)"


# -- OpenAI batch files ----------------------------------------------------------------------------
def batch_line(custom_id, messages, url="/v1/chat/completions", **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", "messages": messages, **body}}


CONVERSATIONS = [[{"role": "user", "content": "hello"}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}],
                 [{"role": "user", "content": "count"}]]


def test_an_openai_batch_file_in_and_out(make_config, chat_checkpoint, tmp_path, one_thread):
    lines = [batch_line("req-a", CONVERSATIONS[0], max_completion_tokens=4),
             batch_line("req-b", CONVERSATIONS[1], max_tokens=6, temperature=0.0),
             batch_line("req-c", CONVERSATIONS[2], url="/v1/embeddings"),
             batch_line("req-d", CONVERSATIONS[2], max_tokens=2.5)]
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    common = (f"job.input={path}", f"model.path={chat_checkpoint}", "model.dtype=float32", "sampling.ignore_eos=true")
    out = run(make_config, tmp_path / "run", *common, "job.output_format=openai") / "generations.jsonl"
    results = [json.loads(line) for line in out.read_text().splitlines()]

    llm = LLM(model=str(chat_checkpoint), dtype="float32", max_model_len=256, device="cpu")
    expected = llm.chat(CONVERSATIONS[:2], [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 6)])
    assert [r["custom_id"] for r in results] == ["req-a", "req-b", "req-c", "req-d"]
    for result, want in zip(results, expected):
        body = result["response"]["body"]
        assert result["error"] is None and result["response"]["status_code"] == 200
        assert body["object"] == "chat.completion" and body["model"] == str(chat_checkpoint)
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": want.outputs[0].text}
        assert choice["finish_reason"] == "length" and choice["index"] == 0
        prompt, completion = len(want.prompt_token_ids), len(want.outputs[0].token_ids)
        assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
    batch = results[0]["id"].split("-")[1]  # the file's own token: another run's ids differ
    assert [r["id"] for r in results] == [f"minipaged-{batch}-{row}" for row in range(4)]
    assert results[0]["response"]["body"]["id"] == f"chatcmpl-{batch}-0"
    assert results[2]["response"] == {"status_code": 400, "request_id": f"minipaged-batch-{batch}-2", "body": None}
    again = run(make_config, tmp_path / "again", *common, "job.output_format=openai") / "generations.jsonl"
    assert not {r["id"] for r in results} & {json.loads(line)["id"] for line in again.read_text().splitlines()}
    assert results[2]["error"] == "url '/v1/embeddings' is not supported, only /v1/chat/completions"
    assert results[3]["error"] == "max_tokens 2.5 is not a valid int"

    table = pq.read_table(run(make_config, tmp_path / "run-parquet", *common) / "generations.parquet")
    assert table["id"].to_pylist() == ["req-a", "req-b", "req-c", "req-d"]
    assert table["output_token_ids"].to_pylist()[:2] == [o.outputs[0].token_ids for o in expected]
    assert {"method", "url", "body"} <= set(table.column_names)  # the request carried along


def test_an_openai_batch_needs_a_chat_template(make_config, qwen3_checkpoint, tmp_path):
    checkpoint, _ = qwen3_checkpoint  # its byte-level tokenizer was saved without a template
    path = write_jsonl(tmp_path / "batch.jsonl", [batch_line("a", CONVERSATIONS[0])])
    with pytest.raises(JobError, match=r"job.input is an OpenAI batch \(conversations\), but model '.*' has no "
                                       r"chat template"):
        run(make_config, tmp_path / "run", f"job.input={path}", f"model.path={checkpoint}")

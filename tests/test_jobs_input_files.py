"""The input side of the generate job on inputs that broke it (jobs/inputs.py): non-integral numbers for
integer sampling fields in every kind of input, empty JSONL files, JSONL lines longer than pyarrow's block,
OpenAI message contents given as lists of parts, compressed JSONL and files that are neither format."""
import decimal
import json
import gzip

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_inputs import batch_line, job, run, write_jsonl

import jobs.inputs
from engine.sequence import SamplingParams
from jobs import JobError
from jobs.generate import open_input, to_request
from jobs.inputs import InputFiles, input_rows

INT_FIELDS = ["max_tokens", "min_tokens", "top_k", "seed", "n", "logprobs", "prompt_logprobs"]


def requests(spec) -> list:
    """The requests the job makes of the input's rows (before the engine sees them)."""
    source, columns, _ = open_input(job(spec))
    return [to_request(row, fields, SamplingParams()) for row, fields in input_rows(source, columns, 4)]


# -- 0. stop as a string in some rows and a list in others ----------------------------------------------
def test_stop_strings_and_lists_mix_in_one_jsonl_and_one_batch_file(tmp_path):
    """Both are vLLM's and OpenAI's forms of stop: a file may mix them (they parsed as clashing column types),
    and each row's request stops on what it gave."""
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "abc", "stop": "j"},
                                                   {"prompt": "abd", "stop": ["x", "y"]}, {"prompt": "abe"}])
    assert [r.sampling_params.stop for r in requests(plain)] == [("j",), ("x", "y"), ()]
    messages = [{"role": "user", "content": "hi"}]
    batch = write_jsonl(tmp_path / "batch.jsonl", [batch_line("a", messages, stop="END"),
                                                   batch_line("b", messages, stop=["END", "###"])])
    assert [r.sampling_params.stop for r in requests(batch)] == [("END",), ("END", "###")]


# -- 0b. a sampling value of the wrong JSON type in some rows ---------------------------------------------
@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])  # the types clash across chunks, or inside one
def test_a_sampling_value_of_another_json_type_is_an_error_row_not_the_whole_input(tmp_path, monkeypatch,
                                                                                    chunk_bytes):
    """A per-row value given as another JSON type than the other rows' (a spreadsheet's "5" for max_tokens, a
    boolean temperature, a number for stop) is read as written: its row is an error row naming the field, as
    SamplingParams says of that value alone, and the other rows keep their values exactly (a seed of 2^64 - 1
    too), in a plain JSONL file and in an OpenAI batch file's bodies."""
    monkeypatch.setattr(jobs.inputs, "CHUNK_BYTES", chunk_bytes)
    values = [("max_tokens", 3), ("max_tokens", "5"), ("temperature", 0.5), ("temperature", True),
              ("stop", ["x"]), ("stop", 7), ("seed", 2**64 - 1), ("seed", "9")]
    expected = []
    for field, value in values:
        try:
            expected.append((getattr(SamplingParams(**{field: value}), field), None))
        except ValueError as err:  # the oracle: SamplingParams given the value alone
            expected.append((None, str(err)))
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": f"p{i}", field: value}
                                                   for i, (field, value) in enumerate(values)])
    messages = [{"role": "user", "content": "hi"}]
    batch = write_jsonl(tmp_path / "batch.jsonl", [batch_line(f"b{i}", messages, **{field: value})
                                                   for i, (field, value) in enumerate(values)])
    for spec in (plain, batch):
        got = [(None if r.error else getattr(r.sampling_params, field), r.error)
               for r, (field, _) in zip(requests(spec), values)]
        assert got == expected, spec


@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
def test_rows_need_not_agree_on_the_insides_of_a_value(tmp_path, monkeypatch, chunk_bytes):
    """A value's insides may differ in JSON type between rows (each row's tools declare their own schema, a
    prediction is text or parts, a stop list holds a number): each row is read as written. An ignored field
    (prediction, metadata) changes nothing, a refused one (tools) is its row's error, a stop list with a number
    is its row's error; in an OpenAI batch and a plain JSONL file alike."""
    monkeypatch.setattr(jobs.inputs, "CHUNK_BYTES", chunk_bytes)
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"city": {"type": "string"}}}}}
    other = {"type": "function", "function": {"name": "f", "parameters": {"properties": {"city": {"type": ["x"]}}}}}
    batch = write_jsonl(tmp_path / "batch.jsonl", [
        batch_line("a", messages, tools=[tool]), batch_line("b", messages, tools=[other]),
        batch_line("c", messages, prediction={"content": "text"}, metadata={"k": "v"}, max_tokens=3),
        batch_line("d", messages, prediction={"content": [{"type": "text", "text": "t"}]}, metadata={"k": 5}),
        batch_line("e", messages, stop=["END", 5])])
    assert [r.error for r in requests(batch)] == [
        "body field 'tools' is not supported (it would change what is generated)"] * 2 + [None, None, SAMPLING_STOP]
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "a", "stop": ["END", 5]}, {"prompt": "b", "stop": ["x"]},
                                                   {"prompt": "c", "stop_token_ids": [1, "2"]}])
    assert [(r.error, r.sampling_params and r.sampling_params.stop) for r in requests(plain)] == [
        (SAMPLING_STOP, None), (None, ("x",)), (stop_ids_error(), None)]


SAMPLING_STOP = "stop must be a string or a list of strings, got ['END', 5]"


def stop_ids_error() -> str:
    try:
        SamplingParams(stop_token_ids=[1, "2"])
    except ValueError as err:  # the oracle: SamplingParams given the value alone
        return str(err)


def test_a_key_twice_in_a_line_is_refused_whatever_its_neighbours(tmp_path):
    """A line that repeats a key is refused naming it, also in a chunk that is rewritten (a stop string made a
    list, a value of mixed types read as JSON text), which must not keep the last value silently."""
    for neighbour in ({"prompt": "a"}, {"prompt": "a", "stop": "x"}, {"prompt": "a", "max_tokens": "5"}):
        path = tmp_path / "dup.jsonl"
        path.write_text(json.dumps(neighbour) + '\n{"prompt": "b", "max_tokens": 3, "prompt": "c"}\n')
        with pytest.raises(JobError, match=r"key 'prompt' twice in one row"):
            requests(path)


# -- 1. integer fields given non-integral numbers -----------------------------------------------------
@pytest.mark.parametrize("field", INT_FIELDS)
def test_a_fraction_for_an_integer_field_is_an_error_row_in_every_input(tmp_path, field):
    """2.5 is refused naming the field and 2.0 taken as 2, from a float column, a decimal column (whose
    values int() would cut to 2), a JSONL number and an OpenAI body field."""
    values = [2.5, 2.0]
    pq.write_table(pa.table({"prompt": ["a", "b"], field: values}), tmp_path / "float.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b"], field: pa.array([decimal.Decimal("2.5"), decimal.Decimal("2")],
                                                                    pa.decimal128(5, 1))}), tmp_path / "decimal.parquet")
    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, field: v} for p, v in zip("ab", values)])
    body_field = "top_logprobs" if field == "logprobs" else field
    extra = {"logprobs": True} if field == "logprobs" else {}
    write_jsonl(tmp_path / "batch.jsonl", [batch_line(p, [{"role": "user", "content": p}], **extra, **{body_field: v})
                                           for p, v in zip("ab", values)])
    for name in ("float.parquet", "decimal.parquet", "rows.jsonl", "batch.jsonl"):
        bad, whole = requests(tmp_path / name)
        expected = body_field if name == "batch.jsonl" else field
        assert bad.error == f"{expected} 2.5 is not a valid int" and bad.sampling_params is None, name
        assert whole.error is None and getattr(whole.sampling_params, field) == 2, name
        assert type(getattr(whole.sampling_params, field)) is int, name


def test_the_openai_names_of_renamed_fields_are_the_ones_named(tmp_path):
    path = write_jsonl(tmp_path / "batch.jsonl", [
        batch_line("a", [{"role": "user", "content": "a"}], max_completion_tokens=2.5),
        batch_line("b", [{"role": "user", "content": "b"}], max_tokens=0),
        batch_line("c", [{"role": "user", "content": "c"}], max_completion_tokens=0, max_tokens=5)])
    assert [r.error for r in requests(path)] == ["max_completion_tokens 2.5 is not a valid int",
                                                 "max_tokens must be >= 1, got 0",
                                                 "max_completion_tokens must be >= 1, got 0"]


def test_decimals_and_stop_token_ids_convert_exactly(tmp_path):
    big = 2**53 + 1  # a float64 would make it 2**53
    pq.write_table(pa.table({
        "prompt": ["a", "b"],
        "seed": pa.array([decimal.Decimal(big), decimal.Decimal("7.000")], pa.decimal128(38, 3)),
        "temperature": pa.array([decimal.Decimal("0.5"), None], pa.decimal128(3, 2)),
        "stop_token_ids": pa.array([[decimal.Decimal(3)], [decimal.Decimal("3.5")]], pa.list_(pa.decimal128(3, 1))),
    }), tmp_path / "in.parquet")
    exact, fraction = requests(tmp_path / "in.parquet")
    assert exact.error is None and exact.sampling_params.seed == big
    assert exact.sampling_params.temperature == 0.5 and exact.sampling_params.stop_token_ids == (3,)
    assert fraction.error == "stop_token_ids must be a list of token ids, got [3.5]"


def test_jsonl_seeds_of_64_bits_are_exact_in_every_row(tmp_path):
    """One seed beyond int64 made pyarrow read the column as floats, rounding every seed of 2^53 or more (2^60 + 1
    ran as 2^60): the column is read again exactly. A fraction among them keeps the floats, and its row is the
    error naming it."""
    seeds = [2**64 - 1, 2**60 + 1, 2**60, -5, None]
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a", "seed": s} for s in seeds])
    assert [r.sampling_params.seed for r in requests(rows)] == seeds
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": "a", "seed": 2**64 - 1}, {"prompt": "b", "n": 1.5}])
    assert [(r.error, r.sampling_params and r.sampling_params.seed) for r in requests(other)] == [
        (None, 2**64 - 1), ("n 1.5 is not a valid int", None)]  # a fraction in one column leaves the others exact
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a", "seed": s} for s in (2**64 - 1, 2.5, 7)])
    assert [r.error for r in requests(mixed)] == [
        f"seed {float(2**64)!r} is a float of 2^53 or more, which holds only some ints (the one written may have "
        f"been rounded): give it as an int (in JSONL, a column of ints becomes floats when one of them does not fit "
        f"64 bits)", "seed 2.5 is not a valid int", None]


def test_openai_body_seeds_of_64_bits_are_exact_in_every_row(tmp_path):
    """The bodies' integer fields are read as the plain JSONL columns are: one seed beyond int64 made pyarrow
    read body.seed as floats, so 2^60 + 1 was an error row ("a float of 2^53 or more"); a float literal of an
    int (1e17) was one too. Each runs with its exact value now, and a seed beyond 64 bits is its row's error."""
    bodies = ['"seed": 1152921504606846977', '"seed": 18446744073709551617', '"seed": 1e17',
              '"seed": 18446744073709551615', '"max_completion_tokens": 3.0, "seed": 9007199254740993']
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(f'{{"custom_id": "r{i}", "url": "/v1/chat/completions", "body": {{"model": "m", '
                            f'"messages": [{{"role": "user", "content": "hi"}}], {body}}}}}\n'
                            for i, body in enumerate(bodies)))
    assert [(r.error, r.sampling_params and r.sampling_params.seed) for r in requests(path)] == [
        (None, 2**60 + 1), ("seed must fit in 64 bits (-2^63 to 2^64 - 1), got 18446744073709551617", None),
        (None, 10**17), (None, 2**64 - 1), (None, 2**53 + 1)]
    assert requests(path)[4].sampling_params.max_tokens == 3


@pytest.mark.parametrize("value", [2**63, 2**64 + 5, -2**63 - 1])
def test_jsonl_ids_beyond_64_bits_are_named_with_their_row(tmp_path, value):
    """An id beyond int64 made pyarrow read the id column as floats, refused as "holds double": the message now
    names the id, exactly, and its row. Ids that are fractions are still floats."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "a"}, {"id": 2, "prompt": "b"},
                                               {"id": value, "prompt": "c"}])
    with pytest.raises(JobError) as err:
        open_input(job(path))
    assert str(err.value) == (f"job.id_column: column 'id' of {path} holds {value} (row 2 of the input), beyond the "
                              f"64-bit integer range (-2^63 to 2^63 - 1): give ids this large as strings")
    fractions = write_jsonl(tmp_path / "fractions.jsonl", [{"id": 1.5, "prompt": "a"}, {"id": value, "prompt": "b"}])
    with pytest.raises(JobError, match=r"^job.id_column: column 'id' holds double; ids must be integers or strings$"):
        open_input(job(fractions))


# -- 3. empty JSONL ---------------------------------------------------------------------------------
@pytest.mark.parametrize("output_format", ["parquet", "openai"])
def test_an_empty_jsonl_file_writes_an_empty_output_as_a_0_row_parquet_file_does(make_config, tmp_path, output_format):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n\n")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    outputs = {}
    for name in ("empty.parquet", "empty.jsonl", "blank.jsonl"):
        directory = run(make_config, tmp_path / f"run-{name}", f"job.input={tmp_path / name}",
                        f"job.output_format={output_format}")
        final = directory / ("generations.jsonl" if output_format == "openai" else "generations.parquet")
        outputs[name] = final.read_text() if output_format == "openai" else pq.read_table(final)
    if output_format == "openai":
        assert outputs == {name: "" for name in outputs}
    else:
        reference = outputs.pop("empty.parquet")
        assert reference.num_rows == 0
        assert all(table.schema.remove_metadata() == reference.schema.remove_metadata() and table.num_rows == 0
                   for table in outputs.values())


def test_an_empty_jsonl_file_beside_others_adds_nothing(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.jsonl").write_bytes(b"")
    write_jsonl(tmp_path / "dir" / "b.jsonl", [{"prompt": "x", "n": 2}])
    source = InputFiles(str(tmp_path / "dir"))
    assert source.num_rows == 1 and source.schema.names == ["prompt", "n"]


# -- 4. long lines ------------------------------------------------------------------------------------
def test_a_line_longer_than_pyarrows_block_reads(tmp_path):
    rows = [{"prompt": "short"}, {"prompt": "x" * (5 << 19)}, {"prompt": "after"}]  # 2.5 MiB: over two 1 MiB blocks
    source = InputFiles(str(write_jsonl(tmp_path / "in.jsonl", rows)))
    assert pa.Table.from_batches(list(source.batches(["prompt"], 8))).to_pylist() == rows


def test_line_chunks_cut_after_whole_lines_of_any_length(monkeypatch):
    monkeypatch.setattr(jobs.inputs, "CHUNK_BYTES", 4)
    data = b"a\nbbbbbbbbbb\ncc\nd"
    chunks = list(jobs.inputs.line_chunks(pa.BufferReader(data)))
    assert chunks == [b"a\n", b"bbbbbbbbbb\ncc\n", b"d"]  # cut after the last newline of each read


def test_a_prompt_on_a_long_line_is_an_error_row(make_config, tmp_path, one_thread):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x" * (5 << 19)}, {"prompt": "fine"}])
    directory = run(make_config, tmp_path / "run", f"job.input={path}", "sampling.ignore_eos=true")
    rows = pq.read_table(directory / "generations.parquet").to_pylist()
    assert rows[0]["finish_reason"] == "error"
    assert rows[0]["error"] == f"prompt has {5 << 19} tokens; model.max_model_len 256 leaves no room for output"
    assert rows[1]["finish_reason"] == "length" and rows[1]["output_tokens"] == 3


# -- 5. message contents as lists of parts --------------------------------------------------------------
def parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


def test_text_parts_are_joined_as_vllm_joins_them_and_other_parts_are_error_rows(tmp_path, monkeypatch):
    lines = [batch_line("plain", [{"role": "user", "content": "hi"}]),
             batch_line("parts", [{"role": "system", "content": "be brief"}, {"role": "user", "content": parts("a", "b")}]),
             batch_line("image", [{"role": "user", "content": "look"},
                                  {"role": "user", "content": [*parts("see"), {"type": "image_url",
                                                                               "image_url": {"url": "http://x/y.png"}}]}]),
             batch_line("plain2", [{"role": "user", "content": "bye"}])]
    expected = [[{"role": "user", "content": "hi"}],
                [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}], None,
                [{"role": "user", "content": "bye"}]]
    for chunk_bytes in (1 << 20, 64):  # the mix inside one chunk, and spread over chunks (the schemas unified)
        monkeypatch.setattr(jobs.inputs, "CHUNK_BYTES", chunk_bytes)
        got = requests(write_jsonl(tmp_path / "batch.jsonl", lines))
        assert [r.messages for r in got[:2]] + [got[3].messages] == [expected[0], expected[1], expected[3]]
        assert [r.error for r in got] == [None, None, "messages[1].content[1] is a part of type 'image_url': only "
                                                      "text parts are supported", None]


def test_a_conversation_column_mixing_strings_and_parts_in_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": [{"role": "user", "content": "plain"}], "tag": "a"},
                                               {"prompt": [{"role": "user", "content": parts("x", "y")}], "tag": "b"}])
    assert [r.messages for r in requests(path)] == [[{"role": "user", "content": "plain"}],
                                                    [{"role": "user", "content": "x\ny"}]]


def test_a_conversation_column_of_parts_in_parquet(tmp_path):
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    pq.write_table(pa.table({"prompt": pa.array([[{"role": "user", "content": parts("x", "y", "z")}],
                                                 [{"role": "user", "content": [{"type": "text", "text": None}]}]],
                                                pa.list_(message))}), tmp_path / "in.parquet")
    ok, bad = requests(tmp_path / "in.parquet")
    assert ok.messages == [{"role": "user", "content": "x\ny\nz"}] and ok.error is None
    assert bad.error == "messages[0].content[0] is a text part without text"


def test_parts_give_the_outputs_of_the_joined_strings(make_config, chat_checkpoint, tmp_path, one_thread):
    """The job on a file of mixed contents against the job on the same file with each content a string."""
    conversations = [[{"role": "user", "content": parts("why", "paged attention?")}],
                     [{"role": "user", "content": "hello"}]]
    joined = [[{"role": "user", "content": "why\npaged attention?"}], [{"role": "user", "content": "hello"}]]
    tables = []
    for name, convs in (("parts", conversations), ("strings", joined)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", [batch_line(f"r{i}", c) for i, c in enumerate(convs)])
        directory = run(make_config, tmp_path / name, f"job.input={path}", f"model.path={chat_checkpoint}",
                        "model.dtype=float32")
        tables.append(pq.read_table(directory / "generations.parquet"))
    got, want = (t.select(["id", "prompt_tokens", "output_token_ids", "error"]).to_pylist() for t in tables)
    assert got == want and all(r["error"] is None for r in got)


# -- 9. compressed JSONL and files of neither format --------------------------------------------------
def test_compressed_jsonl_reads_as_the_plain_file(tmp_path):
    rows = [{"prompt": f"p{i}", "n": 1 + i % 2} for i in range(50)]
    plain = write_jsonl(tmp_path / "in.jsonl", rows).read_bytes()
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(plain))
    for name in ("in.jsonl.zst", "in.jsonl.zstd"):
        with pa.output_stream(str(tmp_path / name), compression="zstd") as out:
            out.write(plain)
    for name in ("in.jsonl.gz", "in.jsonl.zst", "in.jsonl.zstd"):
        source = InputFiles(str(tmp_path / name))
        assert pa.Table.from_batches(list(source.batches(["prompt", "n"], 16))).to_pylist() == rows, name
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.jsonl.gz").write_bytes(gzip.compress(plain))
    (tmp_path / "dir" / "b.jsonl.zst").write_bytes((tmp_path / "in.jsonl.zst").read_bytes())
    (tmp_path / "dir" / "c.jsonl").write_bytes(plain)
    source = InputFiles(str(tmp_path / "dir"))
    assert [p.name for p in source.paths] == ["a.jsonl.gz", "b.jsonl.zst", "c.jsonl"]
    assert pa.Table.from_batches(list(source.batches(["prompt", "n"], 64))).to_pylist() == rows * 3


def test_files_of_neither_format_say_what_they_are(tmp_path):
    (tmp_path / "prompts.json.gz").write_bytes(gzip.compress(b'{"prompt": "a"}\n'))
    (tmp_path / "prompts.json").write_text('{"prompt": "a"}\n')
    (tmp_path / "prompts.csv").write_text("id,prompt\n1,hello\n")
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    cases = {
        "prompts.json.gz": r"is not a readable Parquet file \(it is gzip-compressed \(a gzip-compressed JSONL file "
                           r"must be named \*.jsonl.gz\)\)",
        "prompts.json": r"is not a readable Parquet file \(it looks like JSONL: name it \*.jsonl\)",
        "prompts.csv": r"is not a readable Parquet file \(it is text starting 'id,prompt', neither Parquet nor JSONL\)",
        "empty.parquet": r"is not a readable Parquet file \(it is empty \(0 bytes\)\)",
        "broken.jsonl.gz": r"job.input: cannot read .*broken.jsonl.gz \(.*incorrect header check\)",
    }
    for name, message in cases.items():
        with pytest.raises(JobError, match=message):
            InputFiles(str(tmp_path / name))

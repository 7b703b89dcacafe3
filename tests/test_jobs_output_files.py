"""The output side of the generate job (jobs/results.py): input columns named like the output's or the parts'
own columns, in both output formats, and logprobs in the OpenAI batch output."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_inputs import batch_line, job, run, write_jsonl
from transformers import AutoTokenizer

from engine.tokenizer import byte_level_tokenizer
from jobs import JobError
from jobs.generate import generate_job, open_input
from jobs.results import TokenPieces, openai_line


NO_EOS = "sampling.ignore_eos=true"  # every row runs to its max_tokens


# -- 2. names that collide ------------------------------------------------------------------------------
PROMPTS = ["first prompt", "second", "third one"]
COLLIDING = {"prompt_logprobs": [1, None, 0], "logprobs": [2, None, None], "row": [7, 7, 7],
             "sample_index": [9, 9, 9], "output_text": ["x", "y", "z"], "n": [1, 2, 1]}


def test_input_columns_named_like_output_or_internal_columns(make_config, tmp_path, one_thread):
    """Sampling columns named like output columns are read as values, not carried; a carried column named
    `row` (the parts' own name for the input row) merges nothing; in both output formats."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS, **COLLIDING}), path)
    table = pq.read_table(run(make_config, tmp_path / "parquet", f"job.input={path}", NO_EOS) / "generations.parquet")
    rows = table.to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [(0, 0), (1, 0), (1, 1), (2, 0)]  # n of the rows
    tokenizer = byte_level_tokenizer()  # the tiny model's vocabulary
    assert [r["output_text"] for r in rows] == [tokenizer.decode(r["output_token_ids"], skip_special_tokens=True)
                                                for r in rows]  # the output's, not the input's column
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    prompt_tokens = [len(p.encode()) for p in PROMPTS]  # byte-level tokenizer
    # prompt_logprobs=1 and 0: a logprob per prompt token (None for the first), the top 1 for k=1
    assert [len(r["prompt_logprobs"] or []) for r in rows] == [prompt_tokens[0], 0, 0, prompt_tokens[2]]
    assert rows[0]["prompt_logprobs"][0] is None and all(len(t) == 1 for t in rows[0]["prompt_top_logprobs"][1:])
    assert [len(r["output_logprobs"] or []) for r in rows] == [3, 0, 0, 0]  # logprobs=2 on the first row only
    assert all(len(t) == 2 for t in rows[0]["top_logprobs"])
    # the input's other columns named like none of the output's are carried, on each sample's row
    assert table.column_names[-3:] == ["logprobs", "row", "n"]
    assert [r["row"] for r in rows] == [7] * 4 and [r["n"] for r in rows] == [1, 2, 2, 1]

    # the same run directory again in the other format: its saved rows resumed, the Parquet file replaced
    directory = tmp_path / "parquet"
    generate_job(make_config(f"job.input={path}", NO_EOS, "job.output_format=openai", "model.device=cpu",
                             "model.max_model_len=256", "sampling.max_tokens=3"), directory)
    assert sorted(p.name for p in directory.glob("generations.*")) == ["generations.jsonl", "generations.parts"]
    lines = [json.loads(line) for line in (directory / "generations.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["0", "1", "2"]  # one line per input row
    choices = [line["response"]["body"]["choices"] for line in lines]
    assert [[c["index"] for c in cs] for cs in choices] == [[0], [0, 1], [0]]
    assert [c["message"]["content"] for cs in choices for c in cs] == table["output_text"].to_pylist()


def test_keep_columns_cannot_carry_an_output_name(tmp_path):
    for name in ("prompt_logprobs", "sample_index", "top_logprobs"):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"prompt": ["a"], name: [1], "row": [2]}), path)
        assert open_input(job(path))[1].keep == ["row"]
        with pytest.raises(JobError, match=rf"job.keep_columns: '{name}' is also a column of generations.parquet"):
            open_input(job(path, keep_columns=[name]))


# -- 6. logprobs in the OpenAI output ----------------------------------------------------------------------
def test_openai_output_has_the_logprobs_asked_for(make_config, chat_checkpoint, tmp_path, one_thread):
    messages = [{"role": "user", "content": "hello"}]
    path = write_jsonl(tmp_path / "batch.jsonl", [
        batch_line("top2", messages, logprobs=True, top_logprobs=2, max_tokens=12, temperature=1.0, seed=3),
        batch_line("none", messages), batch_line("k0", messages, logprobs=True)])
    common = (f"job.input={path}", f"model.path={chat_checkpoint}", "model.dtype=float32", NO_EOS)
    lines = [json.loads(line) for line in
             (run(make_config, tmp_path / "openai", *common, "job.output_format=openai") / "generations.jsonl")
             .read_text().splitlines()]
    table = pq.read_table(run(make_config, tmp_path / "parquet", *common) / "generations.parquet").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    for line, row in zip(lines, table):
        (choice,) = line["response"]["body"]["choices"]
        if row["output_logprobs"] is None:
            assert choice["logprobs"] is None and line["custom_id"] == "none"
            continue
        content = choice["logprobs"]["content"]
        ids = row["output_token_ids"]
        assert [c["token"] for c in content] == [tokenizer.decode([t]) for t in ids]
        assert [c["logprob"] for c in content] == row["output_logprobs"]
        # the bytes of the tokens, joined, are the bytes the tokenizer's own decoder turns into the text
        assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8", "replace") == \
            tokenizer.decode(ids, skip_special_tokens=False)
        tops = row["top_logprobs"] or [[] for _ in ids]
        assert [[(t["token"], t["logprob"], bytes(t["bytes"]).decode("utf-8", "replace")) for t in c["top_logprobs"]]
                for c in content] == [[(tokenizer.decode([t["token_id"]]), t["logprob"], tokenizer.decode([t["token_id"]]))
                                       for t in top] for top in tops]
    assert [len(c["top_logprobs"]) for c in lines[0]["response"]["body"]["choices"][0]["logprobs"]["content"]] == [2] * 12
    assert all(c["top_logprobs"] == [] for c in lines[2]["response"]["body"]["choices"][0]["logprobs"]["content"])


def test_token_bytes_are_the_tokens_own_for_a_byte_level_tokenizer():
    tokenizer = byte_level_tokenizer()
    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode("é€", add_special_tokens=False)  # one token a byte: 2 + 3 of them
    assert [pieces(t)[1] for t in ids] == [[b] for b in "é€".encode()]
    assert all(pieces(t)[0] == "\ufffd" for t in ids)  # alone, no token is a whole character
    eos = tokenizer.eos_token_id
    assert pieces(eos) == ("<|endoftext|>", list(b"<|endoftext|>"))


@pytest.mark.parametrize("stop_reason, stop_token_id, expected", [
    (None, 9, None),  # an EOS (the model's: 9): null, as vLLM's
    (None, 7, 7),  # a stop id that is not an EOS: the id
    ("END", None, "END"),  # a stop string
    (None, None, None),  # the length, or a grammar complete
])
def test_the_openai_stop_reason_is_vllms(stop_reason, stop_token_id, expected):
    sample = {"id": "a", "sample_index": 0, "output_text": "OK", "finish_reason": "stop", "stop_reason": stop_reason,
              "stop_token_id": stop_token_id, "prompt_tokens": 2, "output_tokens": 3, "error": None}
    line = openai_line(0, [sample], "m", 0, silent_eos=frozenset({9}))
    assert line["response"]["body"]["choices"][0]["stop_reason"] == expected

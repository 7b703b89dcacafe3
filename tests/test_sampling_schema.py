"""One sampling schema: SamplingParams' fields are the sampling.* config keys, the per-row input columns and the
OpenAI body fields, checked by SamplingParams itself; a bad value stops the job (a setting) or marks its row an
error naming the field (a row) while the other rows complete. And the logprob fields' way to the outputs."""
import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.config import SamplingConfig
from engine.errors import ConfigError, RequestError
from engine.generation_config import resolve_sampling
from engine.outputs import Logprob, output_logprobs, prompt_logprobs
from engine.sequence import SamplingParams, Sequence
from jobs import cli as run
from jobs.config import key_help, validate
from jobs.generate import flat_logprobs, generate_job, row_sampling
from jobs.inputs import ROW_SAMPLING, openai_sampling
from jobs.results import generations_schema

FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def test_the_config_keys_and_the_row_columns_are_the_fields(make_config):
    assert [f.name for f in dataclasses.fields(SamplingConfig)] == FIELDS + ["use_generation_config"]
    assert ROW_SAMPLING == FIELDS
    cfg = make_config()
    assert all(cfg.sampling[name] is None for name in FIELDS)  # unset: generation_config.json, else the default
    assert key_help(SamplingConfig)["top_k"] == ("sample from the k most likely tokens; -1 or 0: off "
                                                 "(null: generation_config.json's value, else -1)")
    assert key_help(SamplingConfig)["stop"].endswith("(null: [])")


@pytest.mark.parametrize("override, message", [
    ("sampling.n=0", "sampling.n must be >= 1, got 0"),
    ("sampling.presence_penalty=3", r"sampling.presence_penalty must be in \[-2, 2\], got 3.0"),
    ("sampling.min_tokens=9", r"sampling.min_tokens must be in \[0, max_tokens=64\], got 9"),
    ("sampling.stop=['']", r"sampling.stop must not hold an empty string, got \(''\,\)"),
    ("sampling.logprobs=-1", "sampling.logprobs must be >= 0 or null, got -1"),
    ("sampling.top_k=-2", r"sampling.top_k must be >= 1, or -1 or 0 \(off\), got -2"),
    ("model.eos_token_id=999", r"model.eos_token_id must be a token id below model.vocab_size \(257\)"),
    ("job=bench job.hf_batch_size=0", r"job.hf_batch_size must be >= 1, got 0"),
    ("sampling.stop=7", "sampling.stop must be a string or a list of strings, got 7"),
    ("job.chat_template_kwargs=5", "job.chat_template_kwargs must be a mapping such as {enable_thinking: false}"),
])
def test_impossible_sampling_settings(make_config, override, message):
    extra = ["sampling.max_tokens=8"] if "min_tokens" in override else []
    if extra:
        message = message.replace("64", "8")
    with pytest.raises(ConfigError, match=message):
        validate(make_config(*override.split(), *extra))


@pytest.mark.parametrize("values, message", [
    ({"temperature": "hot"}, "temperature 'hot' is not a valid float"),
    ({"n": 1.5}, "n 1.5 is not a valid int"),
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"ignore_eos": 1}, "ignore_eos 1 is not a valid bool"),
    ({"stop": [1, 2]}, "stop must be a string or a list of strings, got [1, 2]"),
    ({"stop": 7}, "stop must be a string or a list of strings, got 7"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of token ids, got 7"),  # one id alone: not vLLM's either
    ({"top_k": -5}, "top_k must be >= 1, or -1 or 0 (off), got -5"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list of token ids, got ['a']"),
    ({"min_tokens": 5}, "min_tokens must be in [0, max_tokens=4], got 5"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty inf is not a valid float"),
    ({"seed": 2**64}, f"seed must fit in 64 bits (-2^63 to 2^64 - 1), got {2**64}"),  # it wrapped to seed 0
    ({"seed": -2**63 - 1}, f"seed must fit in 64 bits (-2^63 to 2^64 - 1), got {-2**63 - 1}"),
    # the sampler's int64 arrays: a larger value overflowed them mid-run
    ({"top_k": 2**63}, f"top_k must be < 2^63, got {2**63}"),
    ({"max_tokens": 10**20, "min_tokens": 10**19}, f"min_tokens must be < 2^63, got {10**19}"),
    # JSONL hands over a column of floats when one of its ints exceeds 64 bits: the others may be rounded
    ({"seed": float(2**60 + 1)}, f"seed {float(2**60)!r} is a float of 2^53 or more, which holds only some ints (the "
                                 f"one written may have been rounded): give it as an int (in JSONL, a column of ints "
                                 f"becomes floats when one of them does not fit 64 bits)"),
])
def test_bad_per_row_values_name_the_field(values, message):
    with pytest.raises(RequestError) as err:
        row_sampling(SamplingParams(max_tokens=4), values)
    assert str(err.value) == message


def test_sampling_params_are_frozen_and_clone_as_vllms():
    params = SamplingParams(temperature=0.5, stop=["x"], n=2)
    copy = params.clone()
    assert copy == params and copy is not params
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 16
    with pytest.raises(ValueError, match=r"^max_tokens must be >= 1, got 0$"):  # a change is checked as a new one
        dataclasses.replace(params, max_tokens=0)


def test_top_k_off_is_minus_one_or_zero():
    """vLLM's rule: top_k >= 1 keeps the k most likely tokens, -1 and 0 turn it off (recent vLLM prefers 0; a
    transformers generation_config.json writes 0 for off), below -1 is an error."""
    off = SamplingParams(temperature=1.0, seed=3)
    assert SamplingParams(temperature=1.0, seed=3, top_k=-1) == off
    assert SamplingParams(temperature=1.0, seed=3, top_k=0).top_k == 0
    with pytest.raises(ValueError, match=r"^top_k must be >= 1, or -1 or 0 \(off\), got -2$"):
        SamplingParams(top_k=-2)


@pytest.mark.parametrize("override, stop", [
    ("sampling.stop=QQQ", ("QQQ",)),  # one string, as the README's table has it
    ("sampling.stop='two words'", ("two words",)),
    (r"sampling.stop=[QQQ,'\n\n']", ("QQQ", r"\n\n")),  # Hydra keeps a backslash as it is (README: $'...')
    ("sampling.stop=[]", ()),
])
def test_one_stop_string_on_the_command_line(make_config, override, stop):
    run.check_overrides([override])
    cfg = make_config(override)
    validate(cfg)
    assert resolve_sampling(cfg.sampling, {}).stop == stop


def test_per_row_values_are_converted():
    row = row_sampling(SamplingParams(), {"stop": "end", "n": 2.0, "temperature": 1, "stop_token_ids": [3.0]})
    assert row == SamplingParams(stop=("end",), n=2, temperature=1.0, stop_token_ids=(3,))
    assert openai_sampling({"max_completion_tokens": 5, "max_tokens": 9, "logprobs": True, "top_logprobs": 2}) == \
        {"max_tokens": 5, "logprobs": 2}
    assert openai_sampling({"logprobs": False, "top_k": 4}) == {"top_k": 4}


def test_bad_rows_become_error_rows_naming_the_field(make_config, tmp_path, one_thread):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({
        "prompt": ["ok", "n", "vocab", "stop", "fine", "stop id"],
        "n": [None, 0, None, None, 2, None],
        "logprobs": [None, None, 1000, None, None, None],
        "stop": pa.array([None, None, None, [1, 2], None, None], pa.list_(pa.int64())),  # a list, but not of strings
        # an id past the logits: the min_tokens ban indexed past them mid-run, failing the job at every resume
        "stop_token_ids": pa.array([None, None, None, None, None, [1000]], pa.list_(pa.int64())),
        "min_tokens": [None, None, None, None, None, 2],
    }), path)
    (tmp_path / "run").mkdir()
    generate_job(make_config(f"job.input={path}", "model.device=cpu", "model.max_model_len=128",
                             "sampling.max_tokens=3", "sampling.ignore_eos=true"), tmp_path / "run")
    rows = pq.read_table(tmp_path / "run" / "generations.parquet").to_pylist()
    errors = {r["prompt"]: r["error"] for r in rows if r["finish_reason"] == "error"}
    assert errors == {"n": "n must be >= 1, got 0", "vocab": "logprobs must be <= 20 (the vocabulary size or 20, the most the sampler returns), got 1000",
                      "stop": "stop must be a string or a list of strings, got [1, 2]",
                      "stop id": "stop_token_ids must be token ids < 257 (the vocabulary size), got 1000"}
    assert [(r["prompt"], r["sample_index"], r["output_tokens"]) for r in rows if not r["error"]] == \
        [("ok", 0, 3), ("fine", 0, 3), ("fine", 1, 3)]
    names = pq.read_schema(tmp_path / "run" / "generations.parquet").names
    assert {"output_logprobs", "top_logprobs"} <= set(names) and "prompt_logprobs" not in names  # asked by a column


@pytest.mark.parametrize("overrides, message", [
    (["sampling.logprobs=21"], r"^sampling.logprobs must be <= 20 \(the vocabulary size or 20, the most the sampler "
                               r"returns\), got 21$"),
    (["sampling.prompt_logprobs=21"], r"^sampling.prompt_logprobs must be <= 20 "),
    (["model.vocab_size=12", "model.eos_token_id=11", "sampling.logprobs=13"], r"^sampling.logprobs must be <= 12 "),
    (["sampling.stop_token_ids=[1000]", "sampling.min_tokens=1"],
     r"^sampling.stop_token_ids must be token ids < 257 \(the vocabulary size\), got 1000$"),
])
def test_a_job_level_value_that_no_row_could_run_with_stops_the_job(make_config, tmp_path, one_thread, overrides,
                                                                     message):
    """The same limits as a row's value (an error row, above), but a job-level value would make every row an error:
    like any other impossible setting it stops the job before any work, naming the key."""
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), path)
    (tmp_path / "run").mkdir()
    with pytest.raises(ConfigError, match=message):
        generate_job(make_config(f"job.input={path}", "model.device=cpu", "model.max_model_len=64", *overrides),
                     tmp_path / "run")
    assert list((tmp_path / "run").rglob("*.parquet")) == []


def test_openai_bodies_unknown_ignored_and_unsupported_fields_and_n(make_config, chat_checkpoint, tmp_path, one_thread):
    messages = [{"role": "user", "content": "hi"}]
    lines = [{"custom_id": "a", "body": {"messages": messages, "n": 2, "temperature": 1.0, "max_tokens": 3}},
             {"custom_id": "b", "body": {"messages": messages, "temprature": 1.0}},
             {"custom_id": "c", "body": {"messages": messages, "top_logprobs": 2}},
             {"custom_id": "d", "body": {"messages": [{"content": "who?"}], "max_tokens": 3}},
             {"custom_id": "e", "body": {"messages": messages, "max_tokens": 3, "user": "u1", "metadata": {"k": "v"},
                                         "store": False, "stream": False, "parallel_tool_calls": True}},
             {"custom_id": "f", "body": {"messages": messages, "logit_bias": {"7": 100}}}]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "run").mkdir()
    generate_job(make_config(f"job.input={path}", f"model.path={chat_checkpoint}", "model.device=cpu",
                             "model.max_model_len=128", "sampling.ignore_eos=true", "job.output_format=openai"),
                 tmp_path / "run")
    results = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    choices = results[0]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1] and results[0]["response"]["body"]["usage"]["completion_tokens"] == 6
    assert [r["error"] for r in results[1:]] == [
        "body has unknown field 'temprature'; did you mean temperature?", "top_logprobs needs logprobs: true",
        "messages[0] has no role", None, "body field 'logit_bias' is not supported (it would change what is generated)"]
    # OpenAI's fields that change nothing generated are ignored: the row is the same request without them
    assert results[4]["response"]["body"]["usage"]["completion_tokens"] == 3


def test_logprobs_reach_the_api_and_the_columns():
    """What the sampler fills in on a Sequence, as CompletionOutput.logprobs / RequestOutput.prompt_logprobs
    (vLLM's shape: {token: Logprob(logprob, rank)} per position) and as the output columns."""
    seq = Sequence(0, "r", [4, 5, 6], SamplingParams(logprobs=2, prompt_logprobs=1), 10, output_token_ids=[7, 8])
    seq.output_logprobs, seq.output_ranks = [-0.1, -2.0], [1, 3]
    seq.top_logprobs = [[(7, -0.1), (9, -1.5)], [(3, -0.5), (9, -1.0)]]
    seq.prompt_logprobs, seq.prompt_ranks = [None, -1.0, -3.0], [None, 1, 2]
    seq.prompt_top_logprobs = [None, [(5, -1.0)], [(2, -0.2)]]
    positions = output_logprobs(seq)
    assert positions == [{7: Logprob(-0.1, 1), 9: Logprob(-1.5, 2)},
                         {8: Logprob(-2.0, 3), 3: Logprob(-0.5, 1), 9: Logprob(-1.0, 2)}]
    assert flat_logprobs([7, 8], positions, 2) == ([-0.1, -2.0], [
        [{"token_id": 7, "logprob": -0.1}, {"token_id": 9, "logprob": -1.5}],
        [{"token_id": 3, "logprob": -0.5}, {"token_id": 9, "logprob": -1.0}]])
    prompt = prompt_logprobs(seq)
    assert prompt == [None, {5: Logprob(-1.0, 1)}, {6: Logprob(-3.0, 2), 2: Logprob(-0.2, 1)}]
    assert flat_logprobs([4, 5, 6], prompt, 1) == ([None, -1.0, -3.0], [None, [{"token_id": 5, "logprob": -1.0}],
                                                                        [{"token_id": 2, "logprob": -0.2}]])
    zero = Sequence(1, "r", [4], SamplingParams(logprobs=0), 5, output_token_ids=[7])
    zero.output_logprobs, zero.output_ranks = [-0.3], [2]
    assert output_logprobs(zero) == [{7: Logprob(-0.3, 2)}]  # its rank, though no top entry is asked for
    assert flat_logprobs([7], output_logprobs(zero), 0) == ([-0.3], None)  # k = 0: no top_logprobs
    schema = generations_schema(pa.int64(), logprobs=True, prompt_logprobs=True)
    assert schema.field("top_logprobs").type == pa.list_(pa.list_(pa.struct([("token_id", pa.int32()),
                                                                              ("logprob", pa.float32())])))
    assert "output_logprobs" not in generations_schema(pa.int64()).names

"""Chat templates in the generate job: a conversation column (a list of {role, content} structs), or a text column
with job.chat_template=true; token ids against the tokenizer's own apply_chat_template, outputs against
transformers' generate on those ids (float32, greedy)."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_oracle import MAX_TOKENS, reference_outputs
from transformers import AutoTokenizer

from jobs import JobError
from jobs.generate import generate_job

CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why paged attention?"}],
    [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1 2"},
     {"role": "user", "content": "more"}],
]
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


def run_job(make_config, tmp_path, table: pa.Table, *overrides, name="run"):
    pq.write_table(table, tmp_path / f"{name}.parquet")
    cfg = make_config(f"job.input={tmp_path / f'{name}.parquet'}", "model.device=cpu", "model.dtype=float32",
                      "model.max_model_len=256", f"sampling.max_tokens={MAX_TOKENS}", *overrides)
    (tmp_path / name).mkdir()
    generate_job(cfg, tmp_path / name)
    return pq.read_table(tmp_path / name / "generations.parquet").to_pylist()


def test_a_conversation_column_goes_through_the_chat_template(make_config, qwen3_checkpoint, chat_checkpoint, tmp_path,
                                                               one_thread):
    _, hf_model = qwen3_checkpoint  # chat_checkpoint holds the same weights
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    templated = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
                 for c in CONVERSATIONS]
    expected, gap = reference_outputs(hf_model, templated)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    bad = [{"role": "user", "content": "fine"}, {"role": None, "content": "no role"}]
    table = pa.table({"prompt": pa.array(CONVERSATIONS + [bad], pa.list_(MESSAGE))})
    rows = run_job(make_config, tmp_path, table, f"model.path={chat_checkpoint}")
    assert [r["prompt_tokens"] for r in rows[:3]] == [len(t) for t in templated]  # counts the templated prompt
    assert [r["output_token_ids"] for r in rows[:3]] == expected
    assert all(r["prompt"] is None and r["error"] is None for r in rows[:3])
    assert rows[3]["finish_reason"] == "error" and rows[3]["error"] == "messages[1] has no role"


def test_chat_template_true_makes_a_text_prompt_one_user_message(make_config, chat_checkpoint, tmp_path, one_thread):
    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    prompts = ["hello", "why paged attention?"]
    rows = run_job(make_config, tmp_path, pa.table({"prompt": prompts}), f"model.path={chat_checkpoint}",
                   "job.chat_template=true", "job.chat_template_kwargs={brief: true}", "sampling.max_tokens=4")
    for row, prompt in zip(rows, prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False, brief=True)
        assert tokenizer.decode(ids).endswith("<|assistant|>(briefly)")  # the keyword reached the template
        assert row["prompt"] == prompt and row["prompt_tokens"] == len(ids)
    plain = run_job(make_config, tmp_path, pa.table({"prompt": prompts}), f"model.path={chat_checkpoint}",
                    "sampling.max_tokens=4", name="plain")
    assert [r["prompt_tokens"] for r in plain] == [len(p) for p in prompts]  # no template: the bytes


@pytest.mark.parametrize("overrides, table, message", [
    ((), pa.table({"prompt": pa.array([CONVERSATIONS[0]], pa.list_(MESSAGE))}),
     "job.prompt_column 'prompt' holds conversations, but model 'tiny' has no chat template"),
    (("job.chat_template=true",), pa.table({"prompt": ["hi"]}),
     "job.chat_template is true, but model 'tiny' has no chat template"),
])
def test_a_tokenizer_without_a_template_stops_the_job(make_config, tmp_path, overrides, table, message):
    with pytest.raises(JobError, match=message):
        run_job(make_config, tmp_path, table, *overrides)

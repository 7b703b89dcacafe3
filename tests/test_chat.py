"""Chat templates in the generate job: a conversation column (a list of {role, content} structs), or a text column
with job.chat_template=true; token ids against the tokenizer's own apply_chat_template, outputs against
transformers' generate on those ids (float32, greedy). The random models' ChatML-like template against the
conversations written out by hand, through LLM.chat, a conversation column and an OpenAI batch file."""
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_inputs import batch_line, write_jsonl
from test_oracle import MAX_TOKENS, reference_outputs
from transformers import AutoTokenizer

from engine import LLM, RequestError, SamplingParams
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
     "job.prompt_column 'prompt' holds conversations, but model '.*' has no chat template"),
    (("job.chat_template=true",), pa.table({"prompt": ["hi"]}),
     "job.chat_template is true, but model '.*' has no chat template"),
])
def test_a_tokenizer_without_a_template_stops_the_job(make_config, qwen3_checkpoint, tmp_path, overrides, table,
                                                      message):
    path, _ = qwen3_checkpoint  # its byte-level tokenizer was saved without a template
    with pytest.raises(JobError, match=message.replace("'.*'", f"'{re.escape(str(path))}'")):  # the checkpoint named
        run_job(make_config, tmp_path, table, f"model.path={path}", *overrides)


def test_chat_template_kwargs_that_no_prompt_would_reach_stop_the_job(make_config, chat_checkpoint, tmp_path,
                                                                     monkeypatch):
    """Text prompts without job.chat_template go through no template, so its keywords would change nothing:
    the job stops before it loads the model, naming both settings (with job.chat_template=true they reach it:
    test_chat_template_true_makes_a_text_prompt_one_user_message)."""
    import engine.llm

    monkeypatch.setattr(engine.llm.LLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(JobError, match=r"^job.chat_template_kwargs is set, but no prompt goes through the chat "
                                       r"template: job.prompt_column 'prompt' holds text and job.chat_template is "
                                       r"false \(set job.chat_template=true"):
        run_job(make_config, tmp_path, pa.table({"prompt": ["hi"]}), f"model.path={chat_checkpoint}",
                "job.chat_template_kwargs={brief: true}")


# -- the random models' template (engine/tokenizer.py's CHATML_TEMPLATE) -------------------------------------
CHATML = [  # CONVERSATIONS in ChatML's layout, by hand
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhy paged attention?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\ncount<|im_end|>\n<|im_start|>assistant\n1 2<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
    "<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tiny_chat():
    """The tiny model as the jobs below build it, and its greedy outputs on CHATML as text prompts."""
    llm = LLM(model="tiny", dtype="float32", max_model_len=256, device="cpu")
    return llm, llm.generate(CHATML, SamplingParams(max_tokens=MAX_TOKENS))


def test_the_tiny_model_chats_through_chatml(tiny_chat, one_thread):
    llm, expected = tiny_chat
    outputs = llm.chat(CONVERSATIONS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [len(o.prompt_token_ids) for o in outputs] == [len(text.encode()) for text in CHATML]  # a token a byte
    assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in expected]
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]


def test_chat_takes_text_parts_and_tuples_as_vllm_does(tiny_chat, one_thread):
    """OpenAI's content parts (text parts joined with newlines, as vLLM joins them) and a tuple conversation give
    the prompt of the same conversation written plainly; a part that is not text is named."""
    llm, _ = tiny_chat
    plain = llm.chat([{"role": "user", "content": "first\nsecond"}], SamplingParams(max_tokens=2))[0]
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    for conversation in ([{"role": "user", "content": parts}], ({"role": "user", "content": "first\nsecond"},)):
        assert llm.chat(conversation, SamplingParams(max_tokens=2))[0].prompt_token_ids == plain.prompt_token_ids
    image = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(RequestError, match=r"^prompt 0: messages\[0\]\.content\[1\] is a part of type "
                                           r"'image_url': only text parts are supported$"):
        llm.chat([{"role": "user", "content": image}])


def test_a_conversation_column_on_the_tiny_model(make_config, tiny_chat, tmp_path, one_thread):
    _, expected = tiny_chat
    rows = run_job(make_config, tmp_path, pa.table({"prompt": pa.array(CONVERSATIONS, pa.list_(MESSAGE))}))
    assert [r["prompt_tokens"] for r in rows] == [len(text.encode()) for text in CHATML]
    assert [r["output_token_ids"] for r in rows] == [o.outputs[0].token_ids for o in expected]


def test_an_openai_batch_file_on_the_tiny_model(make_config, tiny_chat, tmp_path, one_thread):
    _, expected = tiny_chat
    path = write_jsonl(tmp_path / "batch.jsonl", [batch_line(f"req-{i}", c) for i, c in enumerate(CONVERSATIONS)])
    cfg = make_config(f"job.input={path}", "job.output_format=openai", "model.device=cpu", "model.dtype=float32",
                      "model.max_model_len=256", f"sampling.max_tokens={MAX_TOKENS}")
    (tmp_path / "run").mkdir()
    generate_job(cfg, tmp_path / "run")
    results = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["req-0", "req-1", "req-2"]
    assert [r["response"]["body"]["usage"]["prompt_tokens"] for r in results] == [len(t.encode()) for t in CHATML]
    assert [r["response"]["body"]["choices"][0]["message"]["content"] for r in results] == \
        [o.outputs[0].text for o in expected]


def test_the_readmes_api_example_runs_as_written(one_thread):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = readme.split("## The Python API\n\n```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(example, namespace)  # the tiny model on the CPU: ids in its vocabulary, a chat template
    assert [o.prompt_token_ids for o in namespace["outputs"]][1] == [39, 68, 75, 75, 78]
    assert namespace["llm"].tokenizer.decode([39, 68, 75, 75, 78]) == "Hello"  # as the README says

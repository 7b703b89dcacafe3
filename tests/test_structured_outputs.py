"""Structured outputs through the engine (engine/constraint.py, the model runner's masks), against oracles of
their own: transformers' generate on the same checkpoint with a logits processor written here on the grammar
library directly (greedy, float32, token for token); jsonschema on every JSON output that finished; and the
job's error rows for grammars that cannot compile."""
import concurrent.futures
import json

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine import model_runner
from engine.errors import ConfigError, RequestError
from engine.watchdog import StepTimeout
from jobs.generate import generate_job

MAX_TOKENS = 40
SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "label": {"enum": ["cat", "dog"]}},
     "required": ["ok", "label"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 3}}, "required": ["tag"],
     "additionalProperties": False},
]


class GrammarLogits(LogitsProcessor):
    """transformers' side of the oracle, one sequence: the grammar's mask over the scores at every step, from a
    matcher fed the tokens generated so far."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int):
        self.matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size), grammar)
        self.vocab_size, self.prompt_len, self.fed = vocab_size, None, 0

    def __call__(self, input_ids, scores):
        self.prompt_len = input_ids.shape[1] if self.prompt_len is None else self.prompt_len
        for token in input_ids[0, self.prompt_len + self.fed:].tolist():
            assert self.matcher.consume_token(token)
            self.fed += 1
        mask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(self.matcher, mask, 0)
        llguidance.torch.apply_token_bitmask_inplace(scores, mask)
        return scores


@pytest.fixture(scope="module")
def llm(qwen3_checkpoint):
    path, _ = qwen3_checkpoint
    return LLM(str(path), dtype="float32", device="cpu", max_model_len=128)


def hf_constrained(hf_model, tokenizer, prompt: list[int], grammar: str) -> list[int]:
    processor = GrammarLogits(grammar, tokenizer, hf_model.config.vocab_size)
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                            logits_processor=LogitsProcessorList([processor]))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("params, grammar", [
    (StructuredOutputsParams(choice=["yes", "no", "maybe not"]), llguidance.LLMatcher.grammar_from_regex("(yes|no|maybe not)")),
    (StructuredOutputsParams(regex=r"[0-9]{1,4}(\.[0-9]{2})?"), llguidance.LLMatcher.grammar_from_regex(r"[0-9]{1,4}(\.[0-9]{2})?")),
])
@pytest.mark.parametrize("chunk_rows", [model_runner.FILL_CHUNK_ROWS, 1], ids=["one fill", "a fill a row"])
def test_greedy_constrained_outputs_match_transformers(llm, qwen3_checkpoint, params, grammar, chunk_rows, monkeypatch):
    """With the rows' masks filled at once, or each row's read and filled while the next row's matcher reads."""
    monkeypatch.setattr(model_runner, "FILL_CHUNK_ROWS", chunk_rows)
    path, hf_model = qwen3_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [[5, 17, 99, 3], [120, 7], list(range(30, 52))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=params))
    for prompt, out in zip(prompts, outs):
        expected, ours = hf_constrained(hf_model, tokenizer, prompt, grammar), out.outputs[0].token_ids
        # the engine stops where nothing but EOS can follow; transformers draws that EOS
        assert ours == expected[:len(ours)] and expected[len(ours):] in ([], [tokenizer.eos_token_id]), \
            (prompt, out.outputs[0].text, expected)
        assert out.outputs[0].finish_reason == "stop"
        if params.choice:
            assert out.outputs[0].text in params.choice


class OutputPenalties(LogitsProcessor):
    """vLLM's presence and frequency penalties by their formula, over the tokens generated so far."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency, self.prompt_len = presence, frequency, None

    def __call__(self, input_ids, scores):
        self.prompt_len = input_ids.shape[1] if self.prompt_len is None else self.prompt_len
        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.5}, {"presence_penalty": 1.5, "frequency_penalty": 0.5}])
def test_constrained_rows_beside_penalised_rows(llm, qwen3_checkpoint, penalty):
    """A constraint and a penalty on one row, and a penalty on a row without one, in one batch (the mask went
    onto the penalised logits outside inference mode, which failed on the CPU): greedy, each row token for
    token transformers' with the same penalty (its own for repetition, the formula above for presence and
    frequency) and, for the first, the grammar's mask."""
    path, hf_model = qwen3_checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    regex = r"[a-z]{3,30}"
    prompts = [[5, 17, 99, 3, 5, 17], [120, 7, 120, 7]]
    params = [SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(regex=regex), **penalty),
              SamplingParams(max_tokens=12, ignore_eos=True, **penalty)]
    outs = llm.generate(prompts, params)
    repetition = {"repetition_penalty": penalty["repetition_penalty"]} if "repetition_penalty" in penalty else {}
    for prompt, p, out, grammar in zip(prompts, params, outs, [llguidance.LLMatcher.grammar_from_regex(regex), None]):
        processors = [] if repetition else [OutputPenalties(penalty["presence_penalty"], penalty["frequency_penalty"])]
        processors += [GrammarLogits(grammar, tokenizer, hf_model.config.vocab_size)] if grammar else []
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=p.max_tokens, min_new_tokens=0 if grammar
                                     else p.max_tokens, do_sample=False, logits_processor=LogitsProcessorList(processors),
                                     **repetition)[0, len(prompt):].tolist()
        ours = out.outputs[0].token_ids
        assert ours == expected[:len(ours)] and expected[len(ours):] in ([], [tokenizer.eos_token_id]), (prompt, expected)


def test_json_outputs_validate_in_a_mixed_batch(llm):
    """Four schemas, rows without a constraint and n = 3 samples, sampled with several seeds: every
    constrained output that finished is a document of its schema."""
    prompts, params = [], []
    for seed in range(3):
        for i, schema in enumerate(SCHEMAS):
            prompts.append([10 + i, 20 + seed])
            params.append(SamplingParams(temperature=1.0, seed=seed, n=3, max_tokens=MAX_TOKENS,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
        prompts.append([7, seed])
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=8))
    outs = llm.generate(prompts, params)
    finished = 0
    for out, p in zip(outs, params):
        if p.structured_outputs is None:
            assert len(out.outputs) == 1 and out.outputs[0].finish_reason in ("stop", "length")
            continue
        schema = json.loads(p.structured_outputs.json)
        assert len(out.outputs) == 3
        for sample in out.outputs:
            if sample.finish_reason == "stop":
                jsonschema.validate(json.loads(sample.text), schema)
                finished += 1
    assert finished >= len(SCHEMAS), "the constrained samples were meant to finish their documents"


def test_a_grammar_that_cannot_compile_is_named(llm):
    with pytest.raises(RequestError, match=r"prompt 1: structured_outputs\.regex"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=2),
                                        SamplingParams(max_tokens=2, structured_outputs={"regex": "(unclosed"})])


def test_bad_rows_are_error_rows_and_a_bad_job_setting_stops_the_job(make_config, qwen3_checkpoint, tmp_path):
    path, _ = qwen3_checkpoint
    constraints = [json.dumps({"choice": ["a", "b"]}), json.dumps({"regex": "[0-9"}), None,
                   json.dumps({"json": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}),
                   json.dumps({"regex": "x", "choice": ["y"]})]
    pq.write_table(pa.table({"prompt": ["p0", "p1", "p2", "p3", "p4"], "structured_outputs": constraints}),
                   tmp_path / "in.parquet")
    common = [f"model.path={path}", "model.device=cpu", "model.dtype=float32", "model.max_model_len=128",
              f"job.input={tmp_path / 'in.parquet'}", "sampling.max_tokens=6"]
    for run in ("run", "run2"):
        (tmp_path / run).mkdir()
    generate_job(make_config(*common), tmp_path / "run")
    rows = pq.read_table(tmp_path / "run" / "generations.parquet").to_pylist()
    assert rows[0]["error"] is None and rows[0]["output_text"] in ("a", "b")
    assert rows[2]["error"] is None
    for row, field in ((1, "regex"), (3, "json"), (4, "")):
        assert rows[row]["finish_reason"] == "error" and f"structured_outputs{'.' + field if field else ''}" in \
            rows[row]["error"], rows[row]
    with pytest.raises(ConfigError, match=r"sampling\.structured_outputs\.regex"):
        generate_job(make_config(*common, "sampling.structured_outputs={regex: '(x'}"), tmp_path / "run2")


def test_an_openai_batch_asks_for_json_with_response_format(make_config, chat_checkpoint, tmp_path):
    path = chat_checkpoint
    schema = SCHEMAS[1]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": MAX_TOKENS,
                       "temperature": 1.0, "seed": i,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}}
             for i in range(4)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "run").mkdir()
    generate_job(make_config(f"model.path={path}", "model.device=cpu", "model.dtype=float32",
                             "model.max_model_len=128", f"job.input={tmp_path / 'in.jsonl'}",
                             "job.output_format=openai"), tmp_path / "run")
    done = 0
    for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines():
        choice = json.loads(line)["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            done += 1
    assert done >= 1


def test_constraints_survive_preemption_and_keep_raw_logprobs(qwen3_checkpoint):
    """A pool too small for the batch preempts constrained rows, which recompute and go on where they were:
    the same outputs as a roomy pool. Their logprobs are the raw distribution's (transformers' log-softmax of
    the unmasked logits), not the masked one's."""
    path, hf_model = qwen3_checkpoint
    prompts = [[5 + i, 17, 99, 3 + i] * 3 for i in range(6)]
    params = SamplingParams(max_tokens=MAX_TOKENS, logprobs=0,
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,12}(-[0-9]{1,2})?"))
    roomy = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, block_size=4)
    expected = roomy.generate(prompts, params)
    roomy.close()
    tight = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, block_size=4, num_blocks=20,
                max_num_seqs=6, max_num_batched_tokens=16, admission_headroom=0)  # admissions fill the pool
    outs = tight.generate(prompts, params)
    assert sum(s.preemptions for s in tight.stats().steps) > 0, "the pool was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    tight.close()
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            raw = torch.log_softmax(hf_model(torch.tensor([prompt + tokens])).logits[0].double(), -1)
        for i, token in enumerate(tokens):
            assert out.outputs[0].logprobs[i][token].logprob == pytest.approx(raw[len(prompt) - 1 + i, token].item(),
                                                                              abs=1e-4)


def test_a_stop_string_ends_a_constrained_output_first(llm):
    """A stop string inside the grammar's language ends the output there (its text cut before the string),
    as it would without a constraint; the rest of the grammar is not drawn."""
    params = StructuredOutputsParams(regex=r"ab(cd)+")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=params, stop="c"))[0]
    sample = out.outputs[0]
    assert (sample.text, sample.finish_reason, sample.stop_reason) == ("ab", "stop", "c")
    assert llm.tokenizer.decode(sample.token_ids) == "abc"


def test_a_fill_that_does_not_end_stops_the_run_naming_the_step(qwen3_checkpoint, monkeypatch):
    """The masks fill on a worker thread while the host goes on; a fill that never ends (its Future never
    done) stops the run within scheduler.step_timeout_s, naming the step and its constrained rows."""
    path, _ = qwen3_checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64, step_timeout_s=0.2)
    fills, start_fill = [], model_runner.start_fill_bitmasks

    def fill_that_hangs_at_the_third(pairs, bitmask, *args):
        fills.append(bitmask.shape[0])
        return concurrent.futures.Future() if len(fills) == 3 else start_fill(pairs, bitmask, *args)

    monkeypatch.setattr(model_runner, "start_fill_bitmasks", fill_that_hangs_at_the_third)
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{20,30}"))
    with pytest.raises(StepTimeout, match=r"^step \d+: the grammar masks of its 2 constrained rows were not "
                                          r"filled within 0.2 s \(scheduler.step_timeout_s\)$"):
        llm.generate([[5, 6, 7], [8, 9]], params)
    assert fills == [2, 2, 2]

"""Reasoning parsers (engine/reasoning.py): Qwen3's split of output texts written by hand, in both chat
template modes; reasoning_ended on the token ids of the byte-level tokenizer with <think> and </think>
added (ids 257 and 258: the 256 byte tokens and <|endoftext|> come first); the parsers' errors; the output
processor's split of fake finished sequences; the job's reasoning column, its OpenAI reasoning_content
and its key's check; and a checkpoint whose weights are a bigram table (each token decides the next), so
that its outputs are known by hand, with and without a think block."""
import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from engine.outputs import CompletionOutput, OutputProcessor, RequestOutput
from engine.reasoning import Qwen3ReasoningParser, reasoning_parser
from engine.tokenizer import ENDOFTEXT, byte_level_tokenizer
from jobs.config import validate
from jobs.generate import generate_job, result_rows
from jobs.results import generations_schema, openai_line

THINK, END_THINK, EOS = 257, 258, 256
NEWLINE = 198  # the alphabet's 188 printable bytes come first (sorted), then bytes 0, 1, ... moved past U+00FF
# Qwen3's layout: ChatML turns, and with enable_thinking false an empty think block opened and closed
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
                  "{% endif %}")
HELLO = [{"role": "user", "content": "hi"}]


def think_tokenizer():
    """The byte-level tokenizer with <think> and </think> added as Qwen3 has them: plain added tokens,
    which decoding keeps."""
    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def parser():
    return Qwen3ReasoningParser(think_tokenizer())


# -- split ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nI add 2 and 2.\n</think>\n\n4", "\nI add 2 and 2.\n", "4"),  # thinking: the output opens the block
    ("\nI add 2 and 2.\n</think>\n\n4", "\nI add 2 and 2.\n", "4"),  # the template opened it in the prompt
    ("4", None, "4"),  # enable_thinking false: the prompt holds the empty block, the output none
    ("<think>\nstill adding", "\nstill adding", ""),  # max_tokens ran out while thinking
    ("<think></think>4 ", "", "4 "),  # an empty block; the content keeps its trailing whitespace
    ("\n<think>r</think>  \n a", "r", "a"),  # whitespace before <think>; all of it after </think> goes
    ("<think>use <b>bold</b>, not <think> twice</think>\n<answer>4</answer> <think>",
     "use <b>bold</b>, not <think> twice", "<answer>4</answer> <think>"),  # a <think> inside is text, as after
    ("<think>a</think>b</think>c", "a", "b</think>c"),  # the first </think> closes it
    ("say <think> once", None, "say <think> once"),  # a <think> after the start opens nothing
    ("", None, ""),
])
def test_split(parser, text, reasoning, content):
    assert parser.split(text) == (reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", [
    ("\nstill adding", "\nstill adding", ""),  # cut by max_tokens in a block the prompt opened: all reasoning
    ("\nI add.\n</think>\n\n4", "\nI add.\n", "4"),  # closed: as without the flag
    ("", "", ""),
])
def test_split_of_an_output_whose_prompt_opened_the_block(parser, text, reasoning, content):
    assert parser.split(text, opened_in_prompt=True) == (reasoning, content)


@pytest.mark.parametrize("prompt, opened", [
    ("<|im_start|>assistant\n<think>\n", True),  # a template that opens the block
    ("<|im_start|>assistant\n", False),  # Qwen3's thinking mode: the output opens it
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking false: closed
    ("<think>\nr\n</think>\n\nok<|im_end|>\n<|im_start|>assistant\n", False),  # an earlier turn's, closed
    ("plain text", False),
])
def test_a_prompt_opened_the_block_when_its_last_tag_is_think(parser, prompt, opened):
    assert parser.prompt_opened_reasoning(ids_of(parser.tokenizer, prompt)) is opened


# -- reasoning_ended -----------------------------------------------------------------------------------
def test_the_tags_are_one_token_each(parser):
    tokenizer = parser.tokenizer
    assert ids_of(tokenizer, "<think>\n</think>") == [THINK, NEWLINE, END_THINK]
    assert (parser.start_token_id, parser.end_token_id) == (THINK, END_THINK)


def test_the_chat_templates_prompts_in_both_modes(parser):
    tokenizer = parser.tokenizer
    thinking = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    quiet = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert thinking == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert quiet == thinking + "<think>\n\n</think>\n\n"
    ids = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=False, enable_thinking=False)
    assert ids[-6:] == [THINK, NEWLINE, NEWLINE, END_THINK, NEWLINE, NEWLINE]


def test_reasoning_ends_with_the_generated_end_tag(parser):
    prompt = parser.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=False)
    assert not parser.reasoning_ended(prompt, [])
    assert not parser.reasoning_ended(prompt, ids_of(parser.tokenizer, "<think>\nhmm"))
    assert parser.reasoning_ended(prompt, ids_of(parser.tokenizer, "<think>\nhmm\n</think>"))
    assert parser.reasoning_ended(prompt, ids_of(parser.tokenizer, "<think>\nhmm\n</think>\n\n{\""))


def test_a_prompt_that_closed_the_block_has_ended_the_reasoning(parser):
    prompt = parser.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=False,
                                                  enable_thinking=False)
    assert parser.reasoning_ended(prompt, [])


@pytest.mark.parametrize("prompt", [
    "<|im_start|>assistant\n<think>\n",  # a template that opens the block: the output closes it
    "<think>\nr\n</think>\n\ncalling<|im_end|>\n<|im_start|>user\nresult<|im_end|>\n<|im_start|>assistant\n",  # an
    # earlier turn's block, then more turns: this turn thinks anew
    "plain text",
])
def test_a_prompt_that_did_not_close_the_block_has_not(parser, prompt):
    assert not parser.reasoning_ended(ids_of(parser.tokenizer, prompt), [])


# -- errors --------------------------------------------------------------------------------------------
def test_an_unknown_parser_is_named_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"reasoning_parser: unknown parser 'qwen'; did you mean qwen3\? "
                                          r"\(known: qwen3\)"):
        reasoning_parser("qwen", think_tokenizer())


def test_a_tokenizer_without_the_tags_is_refused():
    with pytest.raises(ConfigError, match="reasoning_parser: the tokenizer has no <think> token"):
        reasoning_parser("qwen3", byte_level_tokenizer())
    tokenizer = byte_level_tokenizer()
    tokenizer.add_tokens(["<think>"])
    with pytest.raises(ConfigError, match="no </think> token"):
        reasoning_parser("qwen3", tokenizer)


def test_tags_that_decoding_skips_are_refused():
    tokenizer = byte_level_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [ENDOFTEXT, "<think>", "</think>"]})
    with pytest.raises(ConfigError, match="<think> token is a special one, which decoding skips"):
        reasoning_parser("qwen3", tokenizer)


# -- the output processor ------------------------------------------------------------------------------
def finished(index: int, token_ids: list[int], output_text: str | None = None, n: int = 2):
    """A finished sample as the output processor reads it (engine/sequence.py's Sequence), ended by EOS."""
    return SimpleNamespace(request_id="r", sample_index=index, sampling=SamplingParams(n=n), prompt_token_ids=[1, 2],
                           output_token_ids=token_ids, output_text=output_text, finish_reason="stop", stop_reason=None)


def test_the_output_processor_splits_each_sample(parser):
    tokenizer = parser.tokenizer
    thought = ids_of(tokenizer, "<think>\nhm\n</think>\n\nOK") + [EOS]
    cut = ids_of(tokenizer, "<think>r</think> cut STOP")  # a stop string cut its text: the output text is given
    processor = OutputProcessor(tokenizer, parser)
    processor.expect("r", "request 7", "Q")
    assert list(processor.outputs([finished(1, cut, "<think>r</think> cut ")])) == []
    (out,) = processor.outputs([finished(0, thought)])
    assert out.request_id == "request 7" and [c.index for c in out.outputs] == [0, 1]
    assert [(c.reasoning, c.text) for c in out.outputs] == [("\nhm\n", "OK"), ("r", "cut ")]
    assert out.outputs[0].token_ids == thought


def test_a_sample_cut_while_thinking_in_a_block_its_prompt_opened_is_all_reasoning(parser):
    tokenizer = parser.tokenizer
    sample = finished(0, ids_of(tokenizer, "\nstill thinking"), n=1)
    sample.prompt_token_ids, sample.finish_reason = ids_of(tokenizer, "<|im_start|>assistant\n<think>\n"), "length"
    processor = OutputProcessor(tokenizer, parser)
    processor.expect("r", 0, None)
    (out,) = processor.outputs([sample])
    assert (out.outputs[0].reasoning, out.outputs[0].text) == ("\nstill thinking", "")


def test_without_a_parser_the_text_is_whole(parser):
    processor = OutputProcessor(parser.tokenizer)
    processor.expect("r", 0, None)
    (out,) = processor.outputs([finished(0, ids_of(parser.tokenizer, "<think>hm</think>OK") + [EOS], n=1)])
    assert (out.outputs[0].reasoning, out.outputs[0].text) == (None, "<think>hm</think>OK")


# -- the job -------------------------------------------------------------------------------------------
def test_result_rows_carry_the_reasoning():
    out = RequestOutput(3, "Q", [1, 2], [CompletionOutput(0, "OK", [5, 6], "stop", reasoning="hm"),
                                         CompletionOutput(1, "OK", [5], "length")])
    assert [row["reasoning"] for row in result_rows(out)] == ["hm", None]


def test_generations_have_a_reasoning_column_with_a_parser():
    assert generations_schema(pa.int64(), reasoning=True).field("reasoning").type == pa.string()
    assert "reasoning" not in generations_schema(pa.int64()).names


def openai_sample(**fields) -> dict:
    return {"id": "a", "sample_index": 0, "output_text": "OK", "finish_reason": "stop", "stop_reason": None,
            "stop_token_id": EOS, "prompt_tokens": 2, "output_tokens": 3, "error": None, **fields}


def test_the_openai_message_has_reasoning_content_with_a_parser():
    def message(**fields):
        return openai_line(0, [openai_sample(**fields)], "m", 0)["response"]["body"]["choices"][0]["message"]

    assert message(reasoning="hm") == {"role": "assistant", "content": "OK", "reasoning_content": "hm"}
    assert message(reasoning=None) == {"role": "assistant", "content": "OK", "reasoning_content": None}
    assert message() == {"role": "assistant", "content": "OK"}


def test_the_job_key_takes_a_known_parser_or_null(make_config):
    validate(make_config("job.reasoning_parser=qwen3"))
    validate(make_config("job.reasoning_parser=null"))
    with pytest.raises(ConfigError, match="job.reasoning_parser must be null or one of qwen3, got 'deepseek_r1'"):
        validate(make_config("job.reasoning_parser=deepseek_r1"))


# -- a checkpoint whose outputs are known ----------------------------------------------------------------
# token -> the token the model draws after it (greedy): ":" starts a think block, "!" reasoning whose
# block the prompt opened, "?" an answer without one
BIGRAMS = {":": "<think>", "<think>": "h", "!": "h", "h": "m", "m": "</think>", "</think>": " ", " ": "O",
           "?": "O", "O": "K", "K": ENDOFTEXT}


@pytest.fixture(scope="module")
def bigram_checkpoint(tmp_path_factory):
    """A Qwen3 checkpoint with the think tokens whose next token depends on the last one alone (BIGRAMS): the
    layers add nothing (their output projections are zero), token i of BIGRAMS has channel i of the
    embeddings to itself, and the LM head maps channel i to its successor; every other logit is 0."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = think_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=None, pad_token_id=EOS)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        layer = model.model.layers[0]
        for param in (model.model.embed_tokens.weight, model.lm_head.weight, layer.self_attn.o_proj.weight,
                      layer.mlp.down_proj.weight):
            param.zero_()
        for channel, (token, successor) in enumerate(BIGRAMS.items()):
            (token_id,), (successor_id,) = (ids_of(tokenizer, text) for text in (token, successor))
            model.model.embed_tokens.weight[token_id, channel] = 1.0
            model.lm_head.weight[successor_id, channel] = 1.0
    path = tmp_path_factory.mktemp("qwen3-thinks")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_bigram_checkpoint_writes_its_tags_into_the_text(bigram_checkpoint, one_thread):
    llm = LLM(str(bigram_checkpoint), device="cpu", dtype="float32", max_model_len=64)
    outputs = llm.generate(["Q:", "Q!", "Q?"], SamplingParams(max_tokens=16))
    assert [o.outputs[0].text for o in outputs] == ["<think>hm</think> OK", "hm</think> OK", "OK"]
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 3
    llm.close()


def test_the_api_splits_each_output(bigram_checkpoint, one_thread):
    llm = LLM(str(bigram_checkpoint), reasoning_parser="qwen3", device="cpu", dtype="float32", max_model_len=64)
    outputs = llm.generate(["Q:", "Q!", "Q?"], SamplingParams(max_tokens=16))
    assert [(o.outputs[0].reasoning, o.outputs[0].text) for o in outputs] == [("hm", "OK"), ("hm", "OK"), (None, "OK")]
    llm.close()


def test_a_model_without_the_tags_is_refused_a_parser():
    with pytest.raises(ConfigError, match=r"reasoning_parser: the tokenizer has no <think> token"):
        LLM("tiny", reasoning_parser="qwen3", device="cpu")


def test_a_constraint_applies_after_the_reasoning(bigram_checkpoint, one_thread):
    """The bigram model thinks "<think>hm</think>", then says " OK". A choice of "OK" alone, from the first
    output on, forces "OK" at once; after the reasoning, it leaves the reasoning as the model writes it and
    removes only the space (the one token it forbids there)."""
    constrained = SamplingParams(max_tokens=16, structured_outputs={"choice": ["OK"]})
    plain = LLM(str(bigram_checkpoint), device="cpu", dtype="float32", max_model_len=64)
    assert plain.generate("Q:", constrained)[0].outputs[0].text == "OK"
    plain.close()
    thinking = LLM(str(bigram_checkpoint), reasoning_parser="qwen3", device="cpu", dtype="float32", max_model_len=64)
    out = thinking.generate("Q:", constrained)[0].outputs[0]
    assert (out.reasoning, out.text, out.finish_reason) == ("hm", "OK", "stop")
    thinking.close()


@pytest.mark.parametrize("output_format", ["parquet", "openai"])
def test_the_job_splits_each_output(make_config, bigram_checkpoint, tmp_path, one_thread, output_format):
    pq.write_table(pa.table({"prompt": ["Q:", "Q!", "Q?", "Q:"], "max_tokens": [16, 16, 16, 3]}), tmp_path / "in.parquet")
    cfg = make_config(f"job.input={tmp_path / 'in.parquet'}", f"model.path={bigram_checkpoint}", "model.device=cpu",
                      "model.dtype=float32", "model.max_model_len=64", "job.reasoning_parser=qwen3",
                      f"job.output_format={output_format}")
    (tmp_path / "run").mkdir()
    generate_job(cfg, tmp_path / "run")
    expected = [("hm", "OK"), ("hm", "OK"), (None, "OK"), ("hm", "")]  # the last ran out of tokens while thinking
    if output_format == "parquet":
        rows = pq.read_table(tmp_path / "run" / "generations.parquet").to_pylist()
        assert [(r["reasoning"], r["output_text"]) for r in rows] == expected
    else:
        lines = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
        assert [line["response"]["body"]["choices"][0]["message"] for line in lines] == \
            [{"role": "assistant", "content": c, "reasoning_content": r} for r, c in expected]

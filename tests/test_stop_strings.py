"""Stop strings and stop ids, against the full greedy output: the output ends at the first occurrence of a stop
string (which may span tokens: the tiny model's byte-level tokenizer has one token per byte, so a two-character
string, or one character of several bytes, spans tokens), its text cut before the string, its token ids those up
to the one that completed it; min_tokens delays every kind of stop."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from jobs.generate import generate_job

PROMPTS = ["hello", "paged attention", "abc", "The quick brown fox"]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return LLM(model="tiny", max_model_len=256, device="cpu", block_size=4)


@pytest.fixture(scope="module")
def full_outputs(tiny):
    """(prompt, greedy token ids, their text) without any stop."""
    outputs = tiny.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [(p, o.outputs[0].token_ids, o.outputs[0].text) for p, o in zip(PROMPTS, outputs)]


def first_stop(tokenizer, ids: list[int], stops: list[str]):
    """The oracle: the fewest tokens whose decoded text holds a stop string, and (where it starts, the string)
    of the one that starts first there; decoding every prefix anew."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            return k, min(found)
    return None


def substrings(text: str) -> list[str]:
    return sorted({text[i:i + n] for n in (1, 2, 3) for i in range(len(text) - n + 1)} - {""},
                  key=lambda s: (len(s), s))


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_stop_string_cuts_the_greedy_output_at_its_first_occurrence(tiny, full_outputs, data):
    prompt, ids, text = data.draw(st.sampled_from(full_outputs))
    stop = data.draw(st.sampled_from([s for s in substrings(text) if "\ufffd" not in s]))
    include = data.draw(st.booleans())
    out = tiny.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=include))[0].outputs[0]
    k, _ = first_stop(tiny.tokenizer, ids, [stop])
    start = text.find(stop)
    assert out.text == text[:start + len(stop) * include]
    assert out.token_ids == ids[:k] and out.finish_reason == "stop" and out.stop_reason == stop


def test_strings_that_span_tokens_and_the_first_of_several(tiny, full_outputs):
    prompt, ids, text = full_outputs[2]
    multibyte = next(c for c in text if len(c.encode()) > 1 and c != "\ufffd")  # one character, several tokens
    wide = text[text.find(multibyte) - 1:text.find(multibyte) + 1]
    late, early = text[40:43], text[10:12]
    for stops in ([multibyte], [wide], [late, early], [early, early[1:]], ["not in the output"]):
        out = tiny.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=stops))[0].outputs[0]
        expected = first_stop(tiny.tokenizer, ids, stops)
        if expected is None:
            assert out.token_ids == ids and out.finish_reason == "length" and out.stop_reason is None
            continue
        k, (start, stop) = expected
        assert out.token_ids == ids[:k] and out.stop_reason == stop and out.text == text[:start], stops


def test_min_tokens_ignores_a_stop_string_completed_before_it(tiny, full_outputs):
    """A one-token string that occurs before min_tokens and again after: the output ends at the second."""
    for prompt, ids, text in full_outputs:
        singles = [(tiny.tokenizer.decode([t]), t) for t in ids]
        repeated = [c for c, t in singles
                    if c.isascii() and c.isprintable() and ids.count(t) >= 2 and ids.index(t) < 20]
        if repeated:
            break
    stop = repeated[0]
    token = ids[[c for c, _ in singles].index(stop)]
    first = ids.index(token)
    min_tokens = first + 2  # the first occurrence is output first + 1 < min_tokens
    out = tiny.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop],
                                               min_tokens=min_tokens))[0].outputs[0]
    second = ids.index(token, first + 1)  # an ASCII character is one byte, one token: no other token makes it
    assert out.token_ids == ids[:second + 1] and out.text == tiny.tokenizer.decode(ids[:second])


def test_a_stop_string_completed_by_the_min_tokens_th_output_ends_nothing(tiny, full_outputs):
    """vLLM's boundary: the first min_tokens outputs are never cut, so a one-token string that is output number
    min_tokens ends nothing, while the same string as output min_tokens + 1 ends the output."""
    for prompt, ids, text in full_outputs:
        firsts = [i for i, t in enumerate(ids[:20]) if ids.index(t) == i and ids.count(t) == 1
                  and tiny.tokenizer.decode([t]).isascii() and tiny.tokenizer.decode([t]).isalnum()]
        if firsts:
            break
    j = firsts[0]  # a character that occurs once in the full output, at output j (one byte, one token)
    stop = tiny.tokenizer.decode([ids[j]])
    cut = tiny.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop], min_tokens=j))
    assert cut[0].outputs[0].token_ids == ids[:j + 1] and cut[0].outputs[0].stop_reason == stop
    kept = tiny.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop], min_tokens=j + 1))
    assert kept[0].outputs[0].token_ids == ids and kept[0].outputs[0].finish_reason == "length"


def test_stop_ids_and_eos_respect_min_tokens(tiny, full_outputs):
    """A stop id (or EOS) drawn before min_tokens outputs ends nothing. (Once the sampler suppresses them
    before min_tokens they are not drawn there at all; either way the output is never shorter.)"""
    prompt, ids, _ = full_outputs[1]
    stop = ids[1]
    for params in (SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop], min_tokens=5),
                   SamplingParams(max_tokens=MAX_TOKENS, min_tokens=5)):
        out = tiny.generate(prompt, params)[0].outputs[0]
        assert len(out.token_ids) >= 5
        ends = [i for i, t in enumerate(out.token_ids) if t in params.stop_token_ids or t in tiny.engine.eos_token_ids]
        assert all(i < 4 or i == len(out.token_ids) - 1 for i in ends)
    alone = tiny.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop]))
    completion = alone[0].outputs[0]  # a stop id: kept in the token ids, its text left out of the text
    assert completion.token_ids == ids[:2] and completion.stop_reason == stop and completion.finish_reason == "stop"
    assert completion.text == tiny.tokenizer.decode(ids[:1])


def test_an_eos_that_is_also_a_stop_id_ends_as_eos(tiny, full_outputs, monkeypatch):
    """As vLLM checks the tokenizer's EOS before the stop ids: a token that is both ends the output with
    stop_reason None."""
    prompt, ids, _ = full_outputs[1]
    monkeypatch.setattr(tiny.engine, "eos_token_ids", frozenset({ids[1]}))
    monkeypatch.setattr(tiny.engine, "silent_eos", frozenset({ids[1]}))  # the tokenizer's EOS, as it were
    completion = tiny.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[ids[1]]))[0].outputs[0]
    assert (completion.token_ids, completion.finish_reason, completion.stop_reason) == (ids[:2], "stop", None)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 256), max_size=40))
def test_incremental_detokenization_equals_decoding_everything(tokens):
    """The incremental text, token by token, is the whole decode of what it emitted, and never more; its window
    is short except while bytes that do not (yet) make a character are held back."""
    from engine.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer)
    for n, token in enumerate(tokens, 1):
        detokenizer.add(token)
        assert detokenizer.text == tokenizer.decode(tokens[:detokenizer.read_offset], skip_special_tokens=True)
        assert tokenizer.decode(tokens[:n], skip_special_tokens=True).startswith(detokenizer.text)
        held = tokenizer.decode(tokens[detokenizer.prefix_offset:n], skip_special_tokens=True)
        # short, unless holding back bytes, or just after releasing them (the window then starts where the
        # held run did, and moves on at the next token)
        assert n - detokenizer.prefix_offset <= 8 or "\ufffd" in held


def sentencepiece_tokenizer():
    """A Llama-2-like tokenizer: Metaspace pre-tokenizer, a decoder that turns "\u2581" into spaces and strips the
    text's first one; a word's token holds its leading space, which it loses when decoded first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.train_from_iterator(["Hello world, the quick brown fox jumps over the lazy dog."] * 50,
                                  trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_outputs_decode_after_their_prompt_as_vllms_do():
    """With a SentencePiece tokenizer the output text is what it adds to its prompt's text (oracle: the whole
    sequence decoded at once), the leading space of its first word kept, token by token and in one decode."""
    from engine.detokenizer import decode_after

    tokenizer = sentencepiece_tokenizer()
    prompt = tokenizer.encode("Hello world")
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        outputs = torch.randint(3, len(tokenizer), (8,), generator=generator).tolist()
        whole = tokenizer.decode(prompt + outputs, skip_special_tokens=True)
        expected = whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        for token in outputs:
            detokenizer.add(token)
        assert detokenizer.text == expected == decode_after(tokenizer, prompt, outputs)
    word = tokenizer.convert_tokens_to_ids("\u2581brown")
    assert decode_after(tokenizer, prompt, [word]) == " brown" and tokenizer.decode([word]) == "brown"


def test_a_sentencepiece_checkpoints_text_reads_on_from_its_prompt(tmp_path):
    """The engine's texts: prompt + text is the whole sequence decoded; a stop string that starts the output
    (a word's leading space included) stops it at its first token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = sentencepiece_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
                     ).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=64)
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in range(8)]
    heads = []  # the outputs' first three characters where they start a word
    for out in llm.generate(["Hello"] * 8, params):
        completion = out.outputs[0]
        whole = tokenizer.decode(out.prompt_token_ids + completion.token_ids, skip_special_tokens=True)
        assert tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True) + completion.text == whole
        heads.append(completion.text[:3] if completion.text.startswith(" ") else None)
    assert any(heads)
    # those as stop strings: the detokenizer's text starts with them too, so each stops at once
    stopped = llm.generate(["Hello"] * 8, [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True,
                                                          stop=[head or "zzz"]) for s, head in enumerate(heads)])
    for out, head in zip(stopped, heads):
        if head:
            assert (out.outputs[0].text, out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("", "stop", head)
    llm.close()


def test_stop_columns_and_settings_in_the_job(make_config, tiny, full_outputs, tmp_path, one_thread):
    (p0, ids0, text0), (p1, ids1, text1) = full_outputs[:2]
    row_stop, config_stop = text0[5:7], text1[8:10]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [p0, p1], "stop": [[row_stop], None],
                             "stop_token_ids": [None, [ids1[3]]]}), path)
    (tmp_path / "run").mkdir()
    generate_job(make_config(f"job.input={path}", "model.device=cpu", "model.max_model_len=256", "cache.block_size=4",
                             f"sampling.max_tokens={MAX_TOKENS}", "sampling.ignore_eos=true",
                             f"sampling.stop=[{config_stop!r}]"),
                 tmp_path / "run")
    rows = pq.read_table(tmp_path / "run" / "generations.parquet").to_pylist()
    k, _ = first_stop(tiny.tokenizer, ids0, [row_stop])  # the row's stop replaces the config's
    assert rows[0]["output_token_ids"] == ids0[:k] and rows[0]["output_text"] == text0[:text0.find(row_stop)]
    assert rows[0]["stop_reason"] == row_stop and rows[0]["stop_token_id"] is None
    assert rows[0]["finish_reason"] == "stop"
    by_string = first_stop(tiny.tokenizer, ids1, [config_stop])[0]
    if by_string > 4:  # the stop id (output 4) comes first
        assert rows[1]["output_token_ids"] == ids1[:4] and rows[1]["stop_token_id"] == ids1[3]
        assert rows[1]["stop_reason"] is None and rows[1]["output_text"] == tiny.tokenizer.decode(ids1[:3])
    else:
        assert rows[1]["output_token_ids"] == ids1[:by_string] and rows[1]["stop_reason"] == config_stop

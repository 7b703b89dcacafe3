"""Tests of structured outputs (engine/structured.py): the params' checks, the compiler's cache and
errors, and the token masks against oracles computed here.

Oracles: on the byte-level tokenizer (engine/tokenizer.py) every token but EOS is one byte, whose value
is read from the token's character by the byte-level alphabet's rule (BYTE_OF_CHAR, checked against the
tokenizer's own encoding); the allowed next tokens of a choice are the bytes that keep the text a prefix
of some choice, those of a regex the bytes after which some short tail makes a full match under Python's
re; EOS is allowed exactly when the text is a choice / a full match. The model's vocabulary (VOCAB) is
wider than the tokenizer's, so the ids without a token must never be allowed. Bitmask application is
checked element by element against the bits read with Python's integer shifts.
"""
import itertools
import json
import random
import re
import threading

import pytest
import torch

import ops
from engine.constraint import Constraint
from engine.structured import (GrammarCompiler, StructuredOutputsParams, allocate_bitmask, fill_bitmasks,
                               start_fill_bitmasks)
from engine.tokenizer import byte_level_tokenizer
from test_fused import DEVICE

VOCAB = 300  # the model's: 43 ids beyond the tokenizer's 257


def _byte_of_char() -> dict[str, int]:
    """The byte-level alphabet: the printable bytes '!'..'~', '¡'..'¬' and '®'..'ÿ' stand for themselves,
    the other 68 bytes, in increasing order, for chr(256), chr(257), ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


TOKENIZER = byte_level_tokenizer()
EOS = TOKENIZER.eos_token_id
BYTE_OF_CHAR = _byte_of_char()
TOKEN_BYTES = {i: bytes([BYTE_OF_CHAR[t]]) for t, i in TOKENIZER.get_vocab().items() if i != EOS}
TOKEN_OF_BYTE = {b[0]: i for i, b in TOKEN_BYTES.items()}


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(TOKENIZER, VOCAB)
    yield compiler
    compiler.close()


def tokens_of(data: bytes) -> list[int]:
    return [TOKEN_OF_BYTE[b] for b in data]


def allowed_ids(bitmask: torch.Tensor, row: int) -> set[int]:
    """The ids < VOCAB whose bit is 1 in bitmask row `row` (bit t % 32 of word t // 32)."""
    words = bitmask[row].tolist()
    return {t for t in range(VOCAB) if (words[t // 32] >> (t % 32)) & 1}


def matcher_after(compiler, params, data: bytes):
    """A fresh matcher of params fed the tokens of `data`, each of which it must accept."""
    matcher = compiler.new_matcher(params, timeout_s=60)
    for token in tokens_of(data):
        assert matcher.accept(token), (params, data, matcher.error)
    return matcher


def test_token_bytes_oracle_matches_the_tokenizer():
    text = 'naïve\t"x" ✓\n'
    assert len(TOKEN_BYTES) == 256 and sorted(b[0] for b in TOKEN_BYTES.values()) == list(range(256))
    assert TOKENIZER.encode(text, add_special_tokens=False) == tokens_of(text.encode())


# -- StructuredOutputsParams ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({}, "structured_outputs: set exactly one of json, regex, choice, grammar, json_object, got none"),
    ({"json": {}, "regex": "a"}, "got json and regex"),
    ({"regex": "a", "choice": ["x"], "json_object": True}, "got regex, choice and json_object"),
    ({"choice": "abc"}, "structured_outputs.choice must be a non-empty list of strings, got 'abc'"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"regex": 5}, "structured_outputs.regex must be a string, got 5"),
    ({"grammar": b"root ::= x"}, "structured_outputs.grammar must be a string"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be a bool, got 'yes'"),
    ({"json": "{not json"}, "structured_outputs.json must be a JSON schema"),
    ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema"),
    ({"json": {"enum": [{1, 2}]}}, "structured_outputs.json must be a JSON schema"),
])
def test_params_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_params_are_canonical_and_hashable():
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    from_dict = StructuredOutputsParams(json=schema)
    from_text = StructuredOutputsParams(json=json.dumps(schema, indent=4))
    assert from_dict == from_text and hash(from_dict) == hash(from_text) and from_dict.key == from_text.key
    assert list(json.loads(from_dict.json)["properties"]) == ["z", "a"]  # property order is kept
    listed = StructuredOutputsParams(choice=["a", "b"])
    assert listed.choice == ("a", "b") and listed == StructuredOutputsParams(choice=("a", "b"))
    keys = [StructuredOutputsParams(regex="a").key, StructuredOutputsParams(grammar="a").key,
            StructuredOutputsParams(choice=["a", "b"]).key, StructuredOutputsParams(choice=["a,b"]).key,
            StructuredOutputsParams(json_object=True).key, StructuredOutputsParams(json={"type": "object"}).key]
    assert len(set(keys)) == len(keys)


def test_from_value():
    params = StructuredOutputsParams(regex="a+")
    assert StructuredOutputsParams.from_value(None) is None
    assert StructuredOutputsParams.from_value(params) is params
    assert StructuredOutputsParams.from_value({"regex": "a+"}) == params
    assert StructuredOutputsParams.from_value({"regex": "a+", "json": None, "json_object": None}) == params
    assert StructuredOutputsParams.from_value('{"choice": ["x", "y"]}') == StructuredOutputsParams(choice=("x", "y"))
    with pytest.raises(ValueError, match=r"unknown key 'regexp'; did you mean regex\?"):
        StructuredOutputsParams.from_value({"regexp": "a+"})
    with pytest.raises(ValueError, match="unknown key 'schema'"):
        StructuredOutputsParams.from_value('{"schema": {}}')
    for bad in ('{"regex": ', "[1]", 5):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputsParams.from_value(bad)
    with pytest.raises(ValueError, match="got regex and grammar"):
        StructuredOutputsParams.from_value({"regex": "a", "grammar": "b"})


# -- GrammarCompiler -----------------------------------------------------------------------------------
def test_one_future_per_key(compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    first = compiler.submit(StructuredOutputsParams(json=schema))
    assert compiler.submit(StructuredOutputsParams(json=json.dumps(schema))) is first
    assert compiler.submit(StructuredOutputsParams(regex="[ab]+")) is compiler.submit(
        StructuredOutputsParams(regex="[ab]+"))
    assert compiler.submit(StructuredOutputsParams(regex="[ab]*")) is not compiler.submit(
        StructuredOutputsParams(regex="[ab]+"))
    first.result(timeout=60)


@pytest.mark.parametrize("kwargs, field", [
    ({"regex": "(ab"}, "regex"),
    ({"regex": "[z-a]"}, "regex"),
    ({"json": {"type": "string", "minLength": "x"}}, "json"),
    ({"json": {"type": "foo"}}, "json"),
    ({"json": {"$ref": "#/definitions/missing"}}, "json"),
    ({"grammar": "root ::= undefined"}, "grammar"),
    ({"grammar": 'root ::= "unterminated'}, "grammar"),
    ({"grammar": "start: undefined"}, "grammar"),
])
def test_bad_grammars_name_the_field(compiler, kwargs, field):
    params = StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field}: \S"):
        compiler.submit(params).result(timeout=60)
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field}: "):
        compiler.new_matcher(params, timeout_s=60)


@pytest.mark.parametrize("eos_token_ids, ends", [(None, {EOS}), ((), {EOS}), ([EOS, 3], {EOS, 3})])
def test_every_eos_id_ends_a_complete_text(eos_token_ids, ends):
    compiler = GrammarCompiler(TOKENIZER, VOCAB, eos_token_ids=eos_token_ids)
    try:
        params = StructuredOutputsParams(regex="ab?")
        bitmask = allocate_bitmask(2, compiler.vocab_size)
        matcher_after(compiler, params, b"").fill_bitmask(bitmask, 0)
        matcher_after(compiler, params, b"a").fill_bitmask(bitmask, 1)
        assert allowed_ids(bitmask, 0) == {TOKEN_OF_BYTE[ord("a")]}
        assert allowed_ids(bitmask, 1) == {TOKEN_OF_BYTE[ord("b")]} | ends
    finally:
        compiler.close()


def test_vocabulary_narrower_than_the_tokenizer():
    narrow = GrammarCompiler(TOKENIZER, 200)
    try:
        assert narrow.vocab_size == len(TOKENIZER)
        assert allocate_bitmask(2, narrow.vocab_size).shape == (2, -(-len(TOKENIZER) // 32))
    finally:
        narrow.close()


# -- masks against oracles -----------------------------------------------------------------------------
CHOICES = ("yes", "no", "nope", 'say "hi"', "back\\slash", "naïve\n", "{x}")


def choice_oracle(prefix: bytes) -> set[int]:
    """Tokens after which the text is still a prefix of a choice, and EOS iff the text is a choice."""
    options = [c.encode() for c in CHOICES]
    allowed = {t for t, b in TOKEN_BYTES.items() if any(o.startswith(prefix + b) for o in options)}
    return allowed | ({EOS} if prefix in options else set())


@pytest.mark.parametrize("fill", [fill_bitmasks, lambda pairs, bitmask: start_fill_bitmasks(pairs, bitmask).result()],
                         ids=["here", "on a worker thread"])
def test_choice_masks_match_the_oracle(compiler, fill):
    params = StructuredOutputsParams(choice=list(CHOICES))
    prefixes = sorted({c.encode()[:k] for c in CHOICES for k in range(len(c.encode()) + 1)})
    matchers = [matcher_after(compiler, params, prefix) for prefix in prefixes]
    rows = random.Random(0).sample(range(len(prefixes)), len(prefixes))  # rows in another order than the list
    bitmask = allocate_bitmask(len(prefixes), compiler.vocab_size)
    fill(zip(matchers, rows), bitmask)
    for prefix, matcher, row in zip(prefixes, matchers, rows):
        assert allowed_ids(bitmask, row) == choice_oracle(prefix), prefix
        extendable = any(o.startswith(prefix) and o != prefix for o in (c.encode() for c in CHOICES))
        assert matcher.is_finished == (not extendable), prefix


def test_a_fill_thread_still_busy_is_a_timeout_not_a_hang():
    """A fill thread on an earlier fill that does not end: the next start gives up after its timeout (and
    that fill never runs); once the earlier one ends, the thread takes fills again."""
    from engine.structured import _FillThread

    thread, release, ran = _FillThread(), threading.Event(), []
    stuck = thread.start(lambda: release.wait(30), None)
    with pytest.raises(TimeoutError, match="still on an earlier fill after 0.05 s"):
        thread.start(lambda: ran.append("given up"), 0.05)
    release.set()
    stuck.result(timeout=30)
    thread.start(lambda: ran.append("next"), 30).result(timeout=30)
    assert ran == ["next"]


def test_choice_rejects_what_the_mask_disallows(compiler):
    params = StructuredOutputsParams(choice=list(CHOICES))
    matcher = matcher_after(compiler, params, b"n")
    assert matcher.error is None and not matcher.is_finished
    assert not matcher.accept(TOKEN_OF_BYTE[ord("x")]) and matcher.error and matcher.is_finished
    assert not matcher.accept(TOKEN_OF_BYTE[ord("o")])  # an error state is never left
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0) == {EOS}
    assert not compiler.new_matcher(params, timeout_s=60).accept(EOS)  # "" is not a choice


def test_eos_ends_a_choice_that_could_go_on(compiler):
    matcher = matcher_after(compiler, StructuredOutputsParams(choice=list(CHOICES)), b"no")  # or "nope"
    assert not matcher.is_finished
    assert matcher.accept(EOS) and matcher.is_finished and matcher.error is None
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0) == {EOS}
    assert not matcher.accept(TOKEN_OF_BYTE[ord("p")])


NUMBER = r"[0-9]{1,3}(\.[0-9]+)?"
# a prefix of a NUMBER match becomes one by at most one more character (a digit after a trailing "."),
# so tails of up to 2 characters over the regex's alphabet find a completion whenever one exists
TAILS = ["".join(t) for n in range(3) for t in itertools.product("0123456789.", repeat=n)]


def can_complete(text: bytes) -> bool:
    return text.isascii() and any(re.fullmatch(NUMBER, text.decode() + tail) for tail in TAILS)


def number_oracle(prefix: bytes) -> set[int]:
    allowed = {t for t, b in TOKEN_BYTES.items() if can_complete(prefix + b)}
    return allowed | ({EOS} if re.fullmatch(NUMBER, prefix.decode()) else set())


def test_regex_masks_match_the_oracle(compiler):
    params = StructuredOutputsParams(regex=NUMBER)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    for text in ("7", "42", "123", "3.14", "100.5", "0.001", "999.9"):
        matcher = compiler.new_matcher(params, timeout_s=60)
        for k, token in enumerate(tokens_of(text.encode())):
            matcher.fill_bitmask(bitmask, 0)
            assert allowed_ids(bitmask, 0) == number_oracle(text[:k].encode()), text[:k]
            assert matcher.accept(token)
        matcher.fill_bitmask(bitmask, 0)
        assert allowed_ids(bitmask, 0) == number_oracle(text.encode()), text
    assert not matcher_after(compiler, params, b"123").accept(TOKEN_OF_BYTE[ord("4")])


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string"}}}}


def test_json_schema_accepts_a_valid_document(compiler):
    document = json.dumps({"name": 'Ada "L" ✓', "age": 36, "tags": ["x", "y"]}, ensure_ascii=False,
                          separators=(",", ":")).encode()  # compact: the JSON grammars' default (JSON_DEFAULTS)
    matcher = compiler.new_matcher(StructuredOutputsParams(json=SCHEMA), timeout_s=60)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    for token in tokens_of(document):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask, 0)
        assert token in allowed and EOS not in allowed  # an object is complete only at its closing brace
        assert matcher.accept(token), matcher.error
    matcher.fill_bitmask(bitmask, 0)
    assert EOS in allowed_ids(bitmask, 0) and matcher.accept(EOS)


@pytest.mark.parametrize("valid, breaking", [
    (b'{"name":"Ada","age":', b'"'),  # age is an integer
    (b'{"name":"Ada","age":', b"-"),  # at least 0
    (b'{"name":"Ada",', b" "),  # compact: no whitespace between tokens
    (b'{"n', b"i"),  # no other property
    (b"", b"["),  # an object
])
def test_json_schema_rejects_a_breaking_token(compiler, valid, breaking):
    matcher = matcher_after(compiler, StructuredOutputsParams(json=SCHEMA), valid)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    (token,) = tokens_of(breaking)
    assert token not in allowed_ids(bitmask, 0)
    assert not matcher.accept(token) and matcher.error


def test_json_object_takes_any_object(compiler):
    params = StructuredOutputsParams(json_object=True)
    matcher = matcher_after(compiler, params, b'{"a":[1,{"b":null}],"c":"d"}')
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert EOS in allowed_ids(bitmask, 0)
    assert not compiler.new_matcher(params, timeout_s=60).accept(TOKEN_OF_BYTE[ord("[")])


def test_gbnf_grammar(compiler):
    params = StructuredOutputsParams(grammar='root ::= "id-" [0-9]+ ("," [0-9]+)*')
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    for text, complete in ((b"id-", False), (b"id-12", True), (b"id-12,", False), (b"id-12,3", True)):
        matcher_after(compiler, params, text).fill_bitmask(bitmask, 0)
        assert (EOS in allowed_ids(bitmask, 0)) == complete, text
    assert not matcher_after(compiler, params, b"id-1").accept(TOKEN_OF_BYTE[ord("a")])


# -- bitmasks --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab, words", [(1, 1), (32, 1), (33, 2), (VOCAB, 10)])
def test_allocate_bitmask(vocab, words):
    bitmask = allocate_bitmask(3, vocab)
    assert bitmask.shape == (3, words) and bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
    assert (bitmask == -1).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab, words", [(VOCAB, 10), (VOCAB, 5), (40, 10), (5000, 157)])  # exact, narrower, wider
@pytest.mark.parametrize("rows", [None, [4, 0, 2]])  # every row, or three of six in another order
def test_apply_token_bitmask_matches_the_bits(backend, seed, dtype, vocab, words, rows):
    generator = torch.Generator().manual_seed(seed)
    num_rows = 6 if rows else 4
    logits = torch.randn(num_rows, vocab, generator=generator).to(dtype)
    logits[torch.rand(num_rows, vocab, generator=generator) < 0.05] = float("inf")  # -inf when disallowed, as any
    logits[0, :3] = float("nan")  # stays NaN, allowed or not
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (len(rows or range(num_rows)), words), generator=generator,
                            dtype=torch.int64).to(torch.int32)
    expected = logits.clone()
    for (i, r), t in itertools.product(enumerate(rows or range(num_rows)), range(vocab)):
        if not expected[r, t].isnan() and (t >= 32 * words or not (int(bitmask[i, t // 32]) >> (t % 32)) & 1):
            expected[r, t] = float("-inf")
    out = ops.apply_token_bitmask(logits.to(DEVICE), bitmask.to(DEVICE),
                                  None if rows is None else torch.tensor(rows, device=DEVICE), backend=backend)
    assert torch.equal(out.cpu().nan_to_num(7.0), expected.nan_to_num(7.0)), seed

"""llguidance (engine/structured.py) against xgrammar on the same tokenizer and JSON schemas (issue 30's
choice of library): each of grammar_backends.py's four JSON schemas compiled, its mask filled before each
token of a valid output (compact separators, as the engine's grammars), then ROWS rows a step over 60 steps
(the four schemas, at staggered places in their outputs): the library's parallel fill, and the accepts one
by one; medians. xgrammar is not a dependency: `pip install xgrammar` beside torch first (it brings
apache-tvm-ffi and pydantic).
Usage: python benchmarks/grammar_libraries.py TOKENIZER_DIR [ROWS]   (e.g. .bench/bpe151k, 512)
"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import xgrammar  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from benchmarks.grammar_backends import constraints  # noqa: E402
from engine.structured import GrammarCompiler, allocate_bitmask, fill_bitmasks  # noqa: E402

VOCAB = 151936  # Qwen3's logits width
STEPS = 60


class Llguidance:
    def __init__(self, hf):
        self.compiler = GrammarCompiler(hf, VOCAB)

    def matcher(self, params):
        return self.compiler.new_matcher(params, None)

    def bitmask(self, rows):
        return allocate_bitmask(rows, self.compiler.vocab_size)

    def fill(self, matcher, bitmask):
        matcher.fill_bitmask(bitmask, 0)

    def fill_rows(self, matchers, bitmask):
        fill_bitmasks(zip(matchers, range(len(matchers))), bitmask)

    @staticmethod
    def accept(matcher, token):
        return matcher.accept(token)


class Xgrammar:
    def __init__(self, hf):
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[hf.eos_token_id])
        self.compiler, self.compiled, self.batch = xgrammar.GrammarCompiler(info), {}, xgrammar.BatchGrammarMatcher()

    def matcher(self, params):
        if params.key not in self.compiled:
            self.compiled[params.key] = self.compiler.compile_json_schema(params.json, any_whitespace=False,
                                                                          separators=(",", ":"))
        return xgrammar.GrammarMatcher(self.compiled[params.key])

    def bitmask(self, rows):
        return xgrammar.allocate_token_bitmask(rows, VOCAB)

    def fill(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(bitmask, 0)

    def fill_rows(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    @staticmethod
    def accept(matcher, token):
        return matcher.accept_token(token)


def us(values) -> str:
    return f"median {statistics.median(values) * 1e6:6.1f} mean {statistics.mean(values) * 1e6:6.1f} us"


def time_rows(library, made, rows: int) -> tuple[float, float]:
    """Median seconds of a step's parallel fill and of its accepts one by one, rows at staggered places."""
    plan = [list(made.values())[i % len(made)] for i in range(rows)]
    matchers, places = [library.matcher(params) for params, _ in plan], [0] * rows
    for i, (_, tokens) in enumerate(plan):
        for token in tokens[:(i // len(made)) % (len(tokens) - 1)]:
            assert library.accept(matchers[i], token)
            places[i] += 1
    bitmask, fills, accepts = library.bitmask(rows), [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        library.fill_rows(matchers, bitmask)
        middle = time.perf_counter()
        for i, (params, tokens) in enumerate(plan):
            assert library.accept(matchers[i], tokens[places[i]])
            places[i] += 1
            if places[i] == len(tokens):
                matchers[i], places[i] = library.matcher(params), 0
        fills.append(middle - start)
        accepts.append(time.perf_counter() - middle)
    return statistics.median(fills), statistics.median(accepts)


def main() -> None:
    hf = AutoTokenizer.from_pretrained(sys.argv[1])
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    made = {name: case for name, case in constraints(hf).items() if name.startswith("json")}
    print(f"{os.cpu_count()} CPUs")
    for library in (Llguidance(hf), Xgrammar(hf)):
        name = type(library).__name__
        for constraint, (params, tokens) in made.items():
            start = time.perf_counter()
            matcher, bitmask, fills = library.matcher(params), library.bitmask(1), []
            compiled = time.perf_counter() - start
            for token in tokens:
                start = time.perf_counter()
                library.fill(matcher, bitmask)
                fills.append(time.perf_counter() - start)
                assert library.accept(matcher, token), (name, constraint)
            print(f"{name:10} {constraint:15} compile {compiled * 1e3:6.1f} ms, fill {us(fills)}")
        fill, accept = time_rows(library, made, rows)
        print(f"{name:10} {rows} rows a step: fill {fill * 1e3:.2f} ms, accepts one by one {accept * 1e3:.2f} ms")


if __name__ == "__main__":
    main()

"""The costs of structured outputs (engine/structured.py, llguidance) on a BPE vocabulary of a real size.

Trains a byte-level BPE tokenizer of --vocab tokens with the `tokenizers` library on the Python standard
library's .py sources (the model's vocabulary padded to a multiple of 128 beyond it), then times, with
time.perf_counter:
- the tokenizer's conversion for llguidance (GrammarCompiler's construction), and a compilation of each
  constraint (four JSON schemas with an open string field, a regex, a choice): new_matcher on a key not
  seen, in a fresh compiler each round, so nothing is cached; the copy new_matcher makes of a compiled one;
- the per-row mask fill along a valid output, token by token (fill_bitmask), and the matchers' accept;
- --rows rows a step over --steps steps, each row a constraint at its own position, advancing a token a
  step and starting again at its output's end: a loop of fill_bitmask, and fill_bitmasks (parallel);
- ops.apply_token_bitmask on [--rows, V] float32 logits (median and min of --repeats), beside llguidance's own
  torch.compile'd apply when --library-apply is given (its first call compiles; the figure is after it).
Usage: python benchmarks/grammar_backends.py [--vocab 32000] [--rows 64] [--steps 200] [--rounds 5]
       [--repeats 50] [--library-apply] [--device cuda] [--site-packages]
With --save DIR it only trains the tokenizer and saves it there: the bench's model.tokenizer for the
structured-outputs job (`--vocab 151643 --site-packages`: Qwen3's count of BPE tokens, its ids).
"""
import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ops  # noqa: E402
from engine.structured import GrammarCompiler, StructuredOutputsParams, allocate_bitmask, fill_bitmasks  # noqa: E402

PROSE = ("The matcher walks the token trie once per step; long string fields are where BPE tokens that "
         "cross quotes and escapes matter most, e.g. \"quoted\" text, a\\path, tabs\tand unicode: naïve ✓.")
CONSTRAINTS = {  # name: (params, a valid output)
    "json person": (
        {"json": {"type": "object", "required": ["name", "age", "bio"], "additionalProperties": False,
                  "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                 "bio": {"type": "string"}}}},
        {"name": "Ada Lovelace", "age": 36, "bio": PROSE}),
    "json order": (
        {"json": {"type": "object", "required": ["id", "items"], "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["sku", "qty", "note"],
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"},
                               "note": {"type": "string"}}}}}}},
        {"id": "ABC-1234", "items": [{"sku": "def parse_args", "qty": 2, "price": 9.5, "note": PROSE},
                                     {"sku": "import os", "qty": 1, "note": "for line in sys.stdin:"}]}),
    "json event": (
        {"json": {"type": "object", "required": ["title", "when", "tags", "details"], "properties": {
            "title": {"type": "string", "maxLength": 80},
            "when": {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                                      "all_day": {"type": "boolean"}}},
            "tags": {"type": "array", "items": {"enum": ["work", "home", "travel", "other"]}},
            "details": {"type": ["string", "null"]}}}},
        {"title": "Release of version 3", "when": {"date": "2024-05-17", "all_day": True},
         "tags": ["work", "travel"], "details": PROSE}),
    "json tool call": (
        {"json": {"type": "object", "required": ["tool", "arguments"], "properties": {
            "tool": {"enum": ["search", "open_file", "run_tests"]},
            "arguments": {"anyOf": [
                {"type": "object", "properties": {"query": {"type": "string"},
                                                  "limit": {"type": "integer", "minimum": 1, "maximum": 100}},
                 "required": ["query"]},
                {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}]}}}},
        {"tool": "search", "arguments": {"query": "class ThreadPoolExecutor(_base.Executor): " + PROSE,
                                         "limit": 20}}),
    "regex": ({"regex": r"[a-z0-9._%+-]{1,64}@([a-z0-9-]{1,63}\.){1,8}[a-z]{2,24}( \(score: [0-9]+\.[0-9]{2}\))?"},
              "jane.doe+python_stdlib@mail.example.co.uk (score: 97.25)"),
    "choice": ({"choice": ["positive", "negative", "neutral", "mixed", "not applicable", "positive, with caveats"]},
               "positive, with caveats"),
}


# Qwen2.5's and Qwen3's special tokens, in their order after the BPE tokens (<|im_end|> is the chat models' EOS)
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                       "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                       "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                       "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                       "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def trained_tokenizer(vocab: int, site_packages: bool = False):
    """A byte-level BPE tokenizer (transformers' fast wrapper) of at most `vocab` BPE tokens, then Qwen's 26
    special tokens (so with vocab 151643 every id is where Qwen3's is, EOS <|im_end|> = 151645), trained on
    the standard library's .py files (and the installed packages' with site_packages: the standard
    library alone has words for ~123k tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if site_packages:
        files += sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator((p.read_text(errors="replace") for p in files), trainer)
    tokenizer.add_special_tokens(QWEN_SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>"), len(files)


def constraints(hf) -> dict[str, tuple[StructuredOutputsParams, list[int]]]:
    """CONSTRAINTS as (params, the output's token ids, EOS last); JSON as the engine's grammars write it,
    without whitespace between tokens (engine/structured.py's JSON_DEFAULTS)."""
    made = {}
    for name, (value, output) in CONSTRAINTS.items():
        text = output if isinstance(output, str) else json.dumps(output, ensure_ascii=False, separators=(",", ":"))
        made[name] = (StructuredOutputsParams.from_value(value),
                      hf.encode(text, add_special_tokens=False) + [hf.eos_token_id])
    return made


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:9.3f}"


def time_compiles(hf, vocab_size: int, made, rounds: int) -> None:
    """Median over rounds of a compiler's construction and of each constraint's first new_matcher."""
    build, compile_s, copy_s = [], {name: [] for name in made}, []
    for _ in range(rounds):
        start = time.perf_counter()
        compiler = GrammarCompiler(hf, vocab_size)
        build.append(time.perf_counter() - start)
        for name, (params, _) in made.items():
            start = time.perf_counter()
            compiler.new_matcher(params, None)
            compile_s[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.new_matcher(made["json person"][0], None)
        copy_s.append(time.perf_counter() - start)
        compiler.close()
    print(f"{'compile (median of %d rounds)' % rounds:<44}{'ms':>9}")
    print(f"  {'GrammarCompiler(): the LLTokenizer':<42}{ms(statistics.median(build))}")
    for name, times in compile_s.items():
        print(f"  {'new_matcher, first: ' + name:<42}{ms(statistics.median(times))}")
    print(f"  {'new_matcher, compiled (a copy)':<42}{ms(statistics.median(copy_s))}")


def time_single_fills(hf, vocab_size: int, made) -> None:
    """fill_bitmask before each token of each constraint's output (a fresh compiler: cold lexers)."""
    compiler = GrammarCompiler(hf, vocab_size)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    print(f"\n{'fill_bitmask, one row, along the output':<44}{'tokens':>7}{'median':>9}{'p90':>9}{'max':>9}"
          f"{'accept':>9}  ms")
    for name, (params, tokens) in made.items():
        matcher = compiler.new_matcher(params, None)
        fills, accepts = [], []
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            middle = time.perf_counter()
            assert matcher.accept(token), (name, matcher.error)
            fills.append(middle - start)
            accepts.append(time.perf_counter() - middle)
        deciles = statistics.quantiles(fills, n=10, method="inclusive")
        print(f"  {name:<42}{len(tokens):>7}{ms(statistics.median(fills))}{ms(deciles[-1])}{ms(max(fills))}"
              f"{ms(statistics.median(accepts))}")
    compiler.close()


def walk_rows(hf, vocab_size: int, made, rows: int, steps: int, parallel: bool) -> list[float]:
    """Seconds per step of filling `rows` rows, over `steps` steps: row i follows constraint i % 6's
    output from token i // 6 on, each step advancing by a token; at the output's end (its EOS) the row
    starts again with a fresh matcher, as a new sequence would."""
    compiler = GrammarCompiler(hf, vocab_size)
    bitmask = allocate_bitmask(rows, compiler.vocab_size)
    names = list(made)
    plan = [made[names[i % len(names)]] for i in range(rows)]
    matchers = [compiler.new_matcher(params, None) for params, _ in plan]
    positions = [0] * rows
    for row, (_, tokens) in enumerate(plan):
        for _ in range(row // len(names) % len(tokens)):
            assert matchers[row].accept(tokens[positions[row]])
            positions[row] += 1
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        if parallel:
            fill_bitmasks(zip(matchers, range(rows)), bitmask)
        else:
            for row, matcher in enumerate(matchers):
                matcher.fill_bitmask(bitmask, row)
        seconds.append(time.perf_counter() - start)
        for row, (params, tokens) in enumerate(plan):
            assert matchers[row].accept(tokens[positions[row]])
            positions[row] += 1
            if positions[row] == len(tokens):
                matchers[row], positions[row] = compiler.new_matcher(params, None), 0
    compiler.close()
    return seconds


def time_batch_fills(hf, vocab_size: int, made, rows: int, steps: int) -> None:
    print(f"\n{'fill %d rows a step, mixed constraints' % rows:<44}{'steps':>7}{'median':>9}{'p90':>9}{'max':>9}  ms")
    for parallel in (False, True):
        seconds = walk_rows(hf, vocab_size, made, rows, steps, parallel)
        deciles = statistics.quantiles(seconds, n=10, method="inclusive")
        label = "fill_bitmasks (parallel)" if parallel else "fill_bitmask per row (a loop)"
        print(f"  {label:<42}{steps:>7}{ms(statistics.median(seconds))}{ms(deciles[-1])}{ms(max(seconds))}")


def timings(run, repeats: int, synchronize) -> list[float]:
    """Seconds of each of `repeats` calls of run, sorted."""
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)


def time_apply(vocab_size: int, rows: int, repeats: int, device: str, library_apply: bool) -> None:
    """ops.apply_token_bitmask (the device's backend) on [rows, vocab_size] float32 logits, a random bitmask."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab_size, generator=generator).to(device)
    bitmask = torch.randint(-2 ** 31, 2 ** 31, (rows, -(-vocab_size // 32)), generator=generator,
                            dtype=torch.int64).to(torch.int32).to(device)
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    applies = {"ops.apply_token_bitmask": ops.apply_token_bitmask}
    if library_apply:
        import llguidance.torch  # imports torch._dynamo (~2 s), which is why engine/structured.py does not
        applies["llguidance apply_token_bitmask_inplace"] = llguidance.torch.apply_token_bitmask_inplace
    print(f"\n{'apply on [%d, %d] float32, %s' % (rows, vocab_size, device):<44}{'median':>16}{'min':>9}  ms")
    for name, apply in applies.items():
        apply(logits.clone(), bitmask)  # a first call (the library's compiles)
        times = timings(lambda: apply(logits, bitmask), repeats, synchronize)
        print(f"  {name:<42}{ms(statistics.median(times)):>16}{ms(times[0])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--library-apply", action="store_true")
    parser.add_argument("--device", default="cpu", help="where apply runs (the fills are on the host)")
    parser.add_argument("--site-packages", action="store_true", help="train on the installed packages too")
    parser.add_argument("--save", metavar="DIR", help="only train and save the tokenizer (a model.tokenizer)")
    args = parser.parse_args()
    start = time.perf_counter()
    hf, num_files = trained_tokenizer(args.vocab, args.site_packages)
    if args.save:
        hf.save_pretrained(args.save)
        print(f"{len(hf)} tokens from {num_files} files in {time.perf_counter() - start:.1f} s: {args.save}")
        return
    vocab_size = -(-(len(hf) + 1) // 128) * 128
    print(f"tokenizer: {len(hf)} tokens, trained on {num_files} files in {time.perf_counter() - start:.1f} s; "
          f"model vocabulary {vocab_size}; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}\n")
    made = constraints(hf)
    time_compiles(hf, vocab_size, made, args.rounds)
    time_single_fills(hf, vocab_size, made)
    time_batch_fills(hf, vocab_size, made, args.rows, args.steps)
    time_apply(vocab_size, args.rows, args.repeats, args.device, args.library_apply)


if __name__ == "__main__":
    main()

"""The Python API (engine/llm.py): the same greedy token ids as transformers and as the command line, outputs
in input order, vLLM's option names, errors before any work, and a streaming core that holds a bounded window."""
import dataclasses
import gc
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from test_oracle import MAX_TOKENS, reference_outputs

from engine import LLM, Request, RequestError, SamplingParams
from engine.config import engine_config
from engine.errors import ConfigError
from engine.llm import RUN_GC_THRESHOLD
from engine.sequence import request_seed

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
TEXTS = ["hello", "paged attention", "a", "the block table maps logical blocks to physical ones"]


@pytest.fixture(scope="module")
def checkpoint_llm(qwen3_checkpoint):
    path, _ = qwen3_checkpoint
    return LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu", block_size=4)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return LLM(model="tiny", max_model_len=128, device="cpu", max_num_seqs=4)


def test_greedy_matches_transformers_and_the_command_line(qwen3_checkpoint, checkpoint_llm, tmp_path):
    path, hf_model = qwen3_checkpoint
    generator = torch.Generator().manual_seed(11)
    id_prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 5, 17, 40)]
    text_ids = [checkpoint_llm.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    expected, gap = reference_outputs(hf_model, id_prompts + text_ids)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"

    outputs = checkpoint_llm.generate(id_prompts + TEXTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == expected

    pq.write_table(pa.table({"prompt": TEXTS}), tmp_path / "in.parquet")
    result = subprocess.run([sys.executable, "-m", "engine.run", f"job.input={tmp_path / 'in.parquet'}",
                             f"hydra.run.dir={tmp_path / 'run'}", f"model.path={path}", "model.dtype=float32",
                             "model.device=cpu", "model.max_model_len=128", f"sampling.max_tokens={MAX_TOKENS}"],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    cli = pq.read_table(tmp_path / "run" / "generations.parquet")["output_token_ids"].to_pylist()
    assert cli == expected[len(id_prompts):]


def test_outputs_come_in_input_order_with_their_fields(tiny):
    prompts = ["hello", [5, 6, 7], "a longer prompt", [200]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 1, 6, 2)]
    outputs = tiny.generate(prompts, params)
    alone = [tiny.generate(p, s)[0] for p, s in zip(prompts, params)]  # one at a time: nothing to mix up
    assert [o.request_id for o in outputs] == [0, 1, 2, 3]
    for out, single, prompt, p in zip(outputs, alone, prompts, params):
        completion = out.outputs[0]
        assert completion.token_ids == single.outputs[0].token_ids and len(completion.token_ids) == p.max_tokens
        assert completion.index == 0 and completion.finish_reason == "length" and completion.logprobs is None
        assert completion.text == tiny.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        if isinstance(prompt, str):
            assert out.prompt == prompt and out.prompt_token_ids == tiny.tokenizer.encode(prompt, add_special_tokens=False)
            assert len(out.prompt_token_ids) == len(prompt.encode())  # byte-level: one token per byte
        else:
            assert out.prompt is None and out.prompt_token_ids == prompt
        assert out.error is None and out.finished


def test_engine_options_take_vllms_names(make_config):
    options = {"dtype": "float32", "max_model_len": 256, "block_size": 8, "gpu_memory_utilization": 0.5,
               "max_num_seqs": 4, "max_num_batched_tokens": 64, "seed": 3, "device": "cpu", "num_blocks": 100,
               "enable_prefix_caching": False}
    cfg = engine_config("tiny", **options)
    sections = {"dtype": "model", "max_model_len": "model", "seed": "model", "device": "model", "block_size": "cache",
                "gpu_memory_utilization": "cache", "num_blocks": "cache", "enable_prefix_caching": "cache",
                "max_num_seqs": "scheduler",
                "max_num_batched_tokens": "scheduler"}
    assert {name: getattr(getattr(cfg, sections[name]), name) for name in options} == options
    # without options: the command line's defaults, composed by Hydra from the same files
    plain, hydra = engine_config("tiny"), make_config()
    for section in ("model", "cache", "scheduler", "sampling"):
        assert dataclasses.asdict(getattr(plain, section)) == OmegaConf.to_container(hydra[section])
    with pytest.raises(TypeError, match=r"^LLM\(\) got unknown engine options: 'max_num_seq' \(did you mean "
                                        r"max_num_seqs\?\), 'swap_space', 'tensor_parallel' \(did you mean "
                                        r"tensor_parallel_size\?\) \(known: admission_headroom, architecture, "):
        LLM(model="tiny", max_num_seq=4, tensor_parallel=2, swap_space=4)
    with pytest.raises(TypeError, match=r"'gpu_memory_utilisation' \(did you mean gpu_memory_utilization\?\)"):
        LLM(model="tiny", gpu_memory_utilisation=0.5)
    with pytest.raises(ConfigError, match=r"block_size: Value 'big' of type 'str' could not be converted to Integer"):
        LLM(model="tiny", block_size="big")
    with pytest.raises(ConfigError, match=r"cache.block_size must be >= 1, got 0"):
        LLM(model="tiny", block_size=0)


def test_model_is_a_conf_name_a_directory_or_a_hub_id(qwen3_checkpoint):
    path, _ = qwen3_checkpoint
    named = engine_config("qwen3-0.6b")
    assert named.model.name == "qwen3-0.6b" and named.model.path is None and named.model.hidden_size == 1024
    assert engine_config(str(path)).model.path == str(path)
    assert engine_config("Qwen/Qwen3-0.6B").model.path == "Qwen/Qwen3-0.6B"  # the loader resolves hub ids


def test_a_tokenizer_of_its_own_serves_a_checkpoint_that_has_none(qwen3_checkpoint, tmp_path):
    """vLLM's tokenizer=: the weights' directory without tokenizer files, the tokenizer in another; the same
    text prompts give the same tokens as the whole checkpoint."""
    import shutil

    path, _ = qwen3_checkpoint
    weights, tokenizer = tmp_path / "weights", tmp_path / "tokenizer"
    weights.mkdir(), tokenizer.mkdir()
    for file in path.iterdir():
        model_file = file.name in ("config.json", "generation_config.json") or file.suffix == ".safetensors"
        shutil.copy(file, weights if model_file else tokenizer)
    options = dict(device="cpu", dtype="float32", max_model_len=64)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    whole = LLM(str(path), **options)
    expected = [o.outputs[0].token_ids for o in whole.generate(["hello", "paged"], params)]
    whole.close()
    split = LLM(str(weights), tokenizer=str(tokenizer), **options)
    assert [o.outputs[0].token_ids for o in split.generate(["hello", "paged"], params)] == expected
    split.close()


def test_a_prompt_that_cannot_run_stops_generate_before_any_work(tiny):
    steps = len(tiny.engine.stats.steps)
    with pytest.raises(RequestError, match=r"prompt 1: prompt has 200 tokens; model.max_model_len 128 leaves no room"):
        tiny.generate(["fine", "x" * 200])
    with pytest.raises(RequestError, match=r"prompt 0: prompt is empty"):
        tiny.generate([""])
    with pytest.raises(ValueError, match=r"2 sampling_params for 3 prompts"):
        tiny.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    assert len(tiny.engine.stats.steps) == steps and not tiny.engine.scheduler.has_work()


def test_dict_prompts_are_vllms(tiny):
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    plain = tiny.generate(["hello", [5, 6, 7]], params)
    as_dicts = tiny.generate([{"prompt": "hello"}, {"prompt_token_ids": [5, 6, 7]}], params)
    assert [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in as_dicts] == \
        [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in plain]
    assert tiny.generate({"prompt": "hello"}, params)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


@pytest.mark.parametrize("prompts, message", [
    (None, "prompts must be a prompt (a string, a list of token ids, or a dict with 'prompt' (a string) or "
           "'prompt_token_ids') or a list of prompts, got None"),
    (7, "prompts must be a prompt (a string, a list of token ids, or a dict with 'prompt' (a string) or "
        "'prompt_token_ids') or a list of prompts, got 7"),
    (["fine", 7], "prompts[1] must be a string, a list of token ids, or a dict with 'prompt' (a string) or "
                  "'prompt_token_ids'; got 7"),
    (["fine", None], "prompts[1] must be a string, a list of token ids, or a dict with 'prompt' (a string) or "
                     "'prompt_token_ids'; got None"),
    ([5, "a"], "prompts[1] must be a token id (an int), got 'a'"),  # one prompt of token ids
    (["fine", [5, 2.5]], "prompts[1][1] must be a token id (an int), got 2.5"),
    (["fine", [True]], "prompts[1][0] must be a token id (an int), got True"),
    ([{"promt": "x"}], "prompts[0] has unknown key 'promt'; did you mean prompt? (a dict prompt holds 'prompt' or "
                       "'prompt_token_ids')"),
    ([{"prompt": "x", "multi_modal_data": {}}], "prompts[0] has unknown key 'multi_modal_data' (a dict prompt holds "
                                                "'prompt' or 'prompt_token_ids')"),
    ([{"prompt": "x", "prompt_token_ids": [1]}], "prompts[0] must hold one of 'prompt' and 'prompt_token_ids', got "
                                                 "{'prompt': 'x', 'prompt_token_ids': [1]}"),
    ([{"prompt": [1, 2]}], "prompts[0]['prompt'] must be a string, got [1, 2]"),
    ([{"prompt_token_ids": "abc"}], "prompts[0]['prompt_token_ids'] must be a list of token ids, got 'abc'"),
    ([{"prompt_token_ids": [1, "b"]}], "prompts[0]['prompt_token_ids'][1] must be a token id (an int), got 'b'"),
    (["fine", [1, 2, 257]], "prompt 1: token id 257 at position 2 is not in the vocabulary [0, 257)"),
    (["fine", {"prompt_token_ids": [-1]}], "prompt 1: token id -1 at position 0 is not in the vocabulary [0, 257)"),
])
def test_bad_prompts_are_named_before_any_work(tiny, prompts, message):
    steps = len(tiny.engine.stats.steps)
    with pytest.raises(RequestError) as err:
        tiny.generate(prompts, SamplingParams(max_tokens=2))
    assert str(err.value) == message
    assert len(tiny.engine.stats.steps) == steps and not tiny.engine.scheduler.has_work()


@pytest.mark.parametrize("params, message", [
    ({"max_tokens": 2}, "sampling_params must be a SamplingParams or None, got {'max_tokens': 2}"),
    ([SamplingParams(), "x"], "sampling_params[1] must be a SamplingParams or None, got 'x'"),
])
def test_bad_sampling_params_are_named_before_any_work(tiny, params, message):
    steps = len(tiny.engine.stats.steps)
    with pytest.raises(RequestError) as err:
        tiny.generate(["a", "b"], params)
    assert str(err.value) == message
    assert len(tiny.engine.stats.steps) == steps


def test_an_out_of_vocabulary_id_in_a_stream_is_that_requests_error(tiny):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    results = {o.request_id: o for o in tiny.stream([Request("ok", prompt="fine", sampling_params=params),
                                                     Request("bad", prompt_token_ids=[3, 999])])}
    assert results["bad"].error == "token id 999 at position 1 is not in the vocabulary [0, 257)"
    assert results["ok"].error is None and len(results["ok"].outputs[0].token_ids) == 2


def test_stream_pulls_requests_only_while_its_window_has_room(tiny):
    prompts = [f"request {i} " * (1 + i % 5) for i in range(24)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    window, pulled, seen = 3, 0, []

    def requests():
        nonlocal pulled
        for i, prompt in enumerate(prompts):
            pulled += 1
            yield Request(i, prompt=prompt, sampling_params=params)
        pulled += 1
        yield Request("null", prompt=None)
        pulled += 1
        yield Request("flagged", prompt="x", error="known bad")

    for out in tiny.stream(requests(), window=window):
        assert pulled - len(seen) <= window, "more requests were pulled than the window holds"
        seen.append(out)
    results = {o.request_id: o for o in seen}
    assert len(seen) == len(results) == len(prompts) + 2
    assert results["null"].error == "prompt is null" and results["null"].outputs == []
    assert results["flagged"].error == "known bad"
    expected = tiny.generate(prompts, params)
    assert [results[i].outputs[0].token_ids for i in range(len(prompts))] == [o.outputs[0].token_ids for o in expected]


def test_a_run_makes_no_cyclic_garbage_and_collects_its_young_objects_rarely(tiny):
    """What lets a run collect its young generation every RUN_GC_THRESHOLD allocations: its objects die by their
    reference counts (the collector finds nothing unreachable after a run with collection off, over samples, stop
    strings, logprobs and prompt logprobs), and the caller's thresholds are back after it."""
    prompts = [f"collected {i} " * (1 + i % 5) for i in range(12)]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=6, stop=["zz"], logprobs=2, prompt_logprobs=1)
    tiny.generate(prompts[:2], params)  # first calls fill caches (compiled patterns, memoised tables)
    before = gc.get_threshold()
    seen = []
    gc.collect()
    gc.disable()
    try:
        for out in tiny.stream((Request(i, prompt=p, sampling_params=params) for i, p in enumerate(prompts))):
            seen.append(gc.get_threshold()[0])
        del out
        assert gc.collect() == 0
    finally:
        gc.enable()
    assert len(seen) == len(prompts) and set(seen) == {max(before[0], RUN_GC_THRESHOLD)}
    assert gc.get_threshold() == before


def test_stream_steps_while_the_scheduler_is_saturated_with_the_schedule_of_queueing_all_first(tiny, monkeypatch):
    """With a window of every request, the stream queues only while fewer than max_num_seqs wait (the rest
    joins as steps run) and the steps are those of queueing all first (the oracle: is_saturated off)."""
    prompts = [f"request {i} " * (1 + i % 7) for i in range(30)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    scheduler, most_waiting = tiny.engine.scheduler, 0

    def requests():
        nonlocal most_waiting
        for i, prompt in enumerate(prompts):
            most_waiting = max(most_waiting, len(scheduler.waiting))
            yield Request(i, prompt=prompt, sampling_params=params)

    def run() -> tuple[list, dict]:
        tiny.engine.block_manager.reset_prefix_cache()  # both runs from the same cache, whatever ran before
        since = len(tiny.stats().steps)
        outputs = {o.request_id: o.outputs[0].token_ids for o in tiny.stream(requests(), window=len(prompts))}
        steps = [{k: v for k, v in dataclasses.asdict(s).items() if k not in ("step", "waiting_seqs", "step_time_s")}
                 for s in tiny.stats(since).steps]
        return outputs, steps

    outputs, steps = run()
    assert most_waiting == scheduler.max_num_seqs - 1  # counted as each request is pulled, before it joins
    monkeypatch.setattr(scheduler, "is_saturated", lambda: False)
    most_waiting = 0
    all_first_outputs, all_first_steps = run()
    assert most_waiting == len(prompts) - 1
    assert steps == all_first_steps and outputs == all_first_outputs


def test_a_stream_left_half_way_does_not_leak_into_the_next(tiny):
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    expected = tiny.generate(["one", "two", "three"], params)
    stream = tiny.stream((Request(i, prompt=f"left {i}", sampling_params=params) for i in range(10)), window=4)
    next(stream)
    stream.close()
    again = tiny.generate(["one", "two", "three"], params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_vllms_none_values_of_sampling_params(tiny):
    """vLLM's SamplingParams takes None for max_tokens (as many as max_model_len leaves room for), seed (each
    request its own), stop and stop_token_ids (none); a 5-token prompt in max_model_len 128 then runs 123 tokens."""
    params = SamplingParams(max_tokens=None, seed=None, stop=None, stop_token_ids=None, ignore_eos=True)
    assert (params.seed, params.stop, params.stop_token_ids) == (None, (), ())
    out = tiny.generate([[5, 6, 7, 8, 9]], params)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (128 - 5, "length")


def test_repeated_prompts_draw_apart_unless_they_share_a_seed(tiny):
    """Without a seed of its own a request draws with request_seed of its number among the requests the LLM has
    run, offset by 2^64 x its seed (the oracle: those seeds given explicitly). Four copies of a prompt give four
    outputs; a second call draws new ones, as vLLM's do (an RL loop's rollouts); a new LLM with the same seed
    draws the same sequence of calls, and another seed others; with one seed for all they are one output."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    fresh = LLM(model="tiny", max_model_len=128, device="cpu", max_num_seqs=4)
    calls = [[o.outputs[0].token_ids for o in fresh.generate(["same"] * 4, params)] for _ in range(2)]
    assert len({tuple(t) for t in calls[0] + calls[1]}) == 8
    explicit = [[o.outputs[0].token_ids for o in tiny.generate(["same"] * 4, [
        dataclasses.replace(params, seed=request_seed(call * 4 + i)) for i in range(4)])] for call in range(2)]
    assert explicit == calls  # tiny has the same weights: model.seed 0 for both
    again = LLM(model="tiny", max_model_len=128, device="cpu", max_num_seqs=4)
    assert [[o.outputs[0].token_ids for o in again.generate(["same"] * 4, params)] for _ in range(2)] == calls
    seeded = LLM(model="tiny", max_model_len=128, device="cpu", max_num_seqs=4, seed=3)
    drawn = [o.outputs[0].token_ids for o in seeded.generate(["same"] * 4, params)]
    expected = seeded.generate(["same"] * 4, [dataclasses.replace(params, seed=request_seed((3 << 64) + i))
                                              for i in range(4)])
    assert drawn == [o.outputs[0].token_ids for o in expected]
    shared = tiny.generate(["same"] * 4, dataclasses.replace(params, seed=7))
    assert len({tuple(o.outputs[0].token_ids) for o in shared}) == 1


def test_use_tqdm_shows_the_requests_finished(tiny, capsys):
    """vLLM's keyword: a progress bar of the requests (on stderr) with use_tqdm=True, none without; the same outputs."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    quiet = tiny.generate(["a", "b", "c"], params)
    assert capsys.readouterr().err == ""
    shown = tiny.generate(["a", "b", "c"], params, use_tqdm=True)
    bar = capsys.readouterr().err
    assert "generate: 100%" in bar and "3/3" in bar, bar
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in quiet]
    assert len(tiny.chat([{"role": "user", "content": "hi"}], params, use_tqdm=True)) == 1


@pytest.mark.parametrize("stop_at", [1, 2, 5])
def test_an_interrupted_generate_leaves_the_llm_as_new(tiny, monkeypatch, stop_at):
    """Ctrl-C (or any error) at the N-th step's launch, after the scheduler has taken its slots: the next call
    runs on a whole pool (every block free, no sequence left) and gives the outputs it gave before."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in tiny.generate(["one", "two", "three"], params)]
    launch, calls = tiny.engine.runner.launch, 0

    def interrupted(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == stop_at:
            raise KeyboardInterrupt
        return launch(*args, **kwargs)

    monkeypatch.setattr(tiny.engine.runner, "launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.generate([f"stopped {i}" for i in range(8)], SamplingParams(max_tokens=20, ignore_eos=True))
    manager = tiny.engine.block_manager
    assert not tiny.engine.has_work and manager.sequences == {} and manager.invariants_ok()
    assert len(manager.free_blocks) == manager.num_physical_blocks
    assert [o.outputs[0].token_ids for o in tiny.generate(["one", "two", "three"], params)] == expected


def test_a_call_inside_a_stream_ends_that_stream_with_an_error(tiny):
    """One stream runs at a time: a generate inside a loop over a stream gets its own outputs (those of a call
    alone), and the stream, resumed, raises rather than yield anything of the other call's or drop results
    silently."""
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in tiny.generate(["inner", "call"], params)]
    outer = [Request(i, prompt=f"outer {i}", sampling_params=params) for i in range(6)]
    stream = tiny.stream(outer, window=2)
    first = next(stream)
    assert first.request_id in range(6)
    assert [o.outputs[0].token_ids for o in tiny.generate(["inner", "call"], params)] == expected
    with pytest.raises(RuntimeError, match="a later generate, chat or stream call on the same LLM took the engine"):
        next(stream)
    assert not tiny.engine.has_work


def test_a_closed_llm_says_so():
    """After close(): generating, the settings and the statistics are a RuntimeError saying so, and a stream
    left open across the close raises it at its next result, its requests aborted first."""
    llm = LLM(model="tiny", max_model_len=64, device="cpu", max_num_seqs=2)
    stream = llm.stream([Request(i, prompt=f"p{i}", sampling_params=SamplingParams(max_tokens=4 + 4 * i))
                         for i in range(6)], window=2)
    next(stream)
    assert llm.engine.has_work
    llm.close()
    assert not llm.engine.has_work
    with pytest.raises(RuntimeError, match="^this LLM is closed: make a new one$"):
        next(stream)
    for _ in range(2):  # the first failure leaves nothing half-done for the second
        for call in (lambda: llm.generate("a"), llm.settings, llm.stats, llm.floor_model, lambda: list(llm.stream([]))):
            with pytest.raises(RuntimeError, match="^this LLM is closed: make a new one$"):
                call()


def test_chat_template_kwargs_of_the_wrong_kind_are_named(tiny):
    conversation = [{"role": "user", "content": "a"}]
    for call in (lambda: tiny.chat(conversation, chat_template_kwargs=5),
                 lambda: tiny.stream([Request(0, messages=conversation)], chat_template_kwargs=["x"])):
        with pytest.raises(TypeError, match="^chat_template_kwargs must be a dict of the chat template's keyword "
                                            "arguments or None, got "):
            call()
    assert not tiny.engine.has_work


def test_a_token_id_that_is_no_int_is_named_in_a_stream(tiny):
    """A bool or a float among a stream request's token ids is named as such (its value may lie in the
    vocabulary), and an int outside the vocabulary as that."""
    requests = [Request("bool", prompt_token_ids=[1, True]), Request("float", prompt_token_ids=[1, 2.0]),
                Request("outside", prompt_token_ids=[1, tiny.vocab_size])]
    errors = {o.request_id: o.error for o in tiny.stream(requests)}
    assert errors == {"bool": "prompt_token_ids[1] must be a token id (an int), got True",
                      "float": "prompt_token_ids[1] must be a token id (an int), got 2.0",
                      "outside": f"token id {tiny.vocab_size} at position 1 is not in the vocabulary "
                                 f"[0, {tiny.vocab_size})"}


@pytest.mark.parametrize("options, error, message", [
    (dict(seed=2**64), ConfigError,
     r"^model.seed must fit in 64 bits \(-2\^63 to 2\^64 - 1\), got 18446744073709551616$"),
    (dict(seed=-2**63 - 1), ConfigError, r"^model.seed must fit in 64 bits"),
    (dict(model=None), TypeError, r"^LLM\(\) model must be a conf/model/ name, a checkpoint directory or a hub id, "
                                  r"got None$"),
])
def test_llm_arguments_out_of_range_are_named(options, error, message):
    """Before any work: a seed beyond 64 bits (torch's generators take -2^63 .. 2^64 - 1), a model that is
    no name or path."""
    with pytest.raises(error, match=message):
        engine_config(**{"model": "tiny", **options})


@pytest.mark.parametrize("request_, error", [
    (Request(0, prompt=5), "prompt must be a string, got 5"),
    (Request(0, prompt_token_ids="abc"), "prompt_token_ids must be a list of token ids, got 'abc'"),
    (Request(0, prompt="x", prompt_token_ids=[5, 6]), "a request takes prompt_token_ids or prompt, not both"),
    (Request(0, prompt="x", sampling_params={"max_tokens": 2}), "sampling_params must be a SamplingParams or None, "
                                                                "got dict"),
])
def test_a_malformed_request_in_a_stream_is_its_error_result(tiny, request_, error):
    results = {o.request_id: o for o in tiny.stream([request_, Request(1, prompt="fine")])}
    assert results[0].error == error and results[0].outputs == []
    assert results[1].error is None and results[1].outputs[0].token_ids


def test_a_stream_item_that_is_not_a_request_is_named(tiny):
    with pytest.raises(TypeError, match=r"^stream: item 1 is str 'hello', not a Request \(generate takes prompts"):
        list(tiny.stream([Request(0, prompt="x"), "hello"]))
    assert [o.request_id for o in tiny.stream([Request(5, prompt="x")])] == [5]  # the LLM goes on


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_a_window_below_one_is_an_error(tiny, window):
    with pytest.raises(ValueError, match=f"window must be a whole number >= 1, got {window!r}"):
        next(tiny.stream([Request(0, prompt="x")], window=window))


def test_chat_applies_the_chat_template(chat_checkpoint, checkpoint_llm):
    with pytest.raises(ConfigError, match=r"model '.*qwen3-tiny.*' has no chat template"):  # saved without one
        checkpoint_llm.chat([{"role": "user", "content": "hi"}])
    llm = LLM(model=str(chat_checkpoint), dtype="float32", max_model_len=128, device="cpu")
    with pytest.raises(RequestError, match=r"^messages must be a conversation \(a list of \{role, content\}\) or a "
                                           r"list of them, got None$"):
        llm.chat(None)
    conversations = [[{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]]
    params = SamplingParams(max_tokens=6)
    for kwargs, suffix in ((None, "<|assistant|>"), ({"brief": True}, "<|assistant|>(briefly)")):
        outputs = llm.chat(conversations, params, chat_template_kwargs=kwargs)
        rendered = ["".join(f"<|{m['role']}|>{m['content']}\n" for m in c) + suffix for c in conversations]
        expected = llm.generate([llm.tokenizer.encode(r, add_special_tokens=False) for r in rendered], params)
        assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in expected]
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert llm.chat(conversations[0])[0].request_id == 0  # one conversation alone
    # vLLM's defaults give way to the kwargs: no generation prompt; a final assistant message continued
    started = conversations[0] + [{"role": "assistant", "content": "well"}]
    for conversation, kwargs, rendered in (
            (conversations[0], {"add_generation_prompt": False}, "<|user|>hi\n"),
            (started, {"continue_final_message": True}, "<|user|>hi\n<|assistant|>well")):
        (output,) = llm.chat(conversation, params, chat_template_kwargs=kwargs)
        assert output.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)

"""Tokenizers: model.tokenizer's, a checkpoint's own, or for random models a byte-level one (256 byte tokens + <|endoftext|>) with a
ChatML-like chat template."""
from transformers import PreTrainedTokenizerFast

from engine.errors import ConfigError
from engine.models.loader import TOKENIZER_FILES, resolve_checkpoint, resolve_model_path

ENDOFTEXT = "<|endoftext|>"
# ChatML's layout with its markers spelled out in byte tokens: as special tokens they would need a larger
# vocabulary, hence other random weights and other outputs for every job on a random model
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([ENDOFTEXT])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT)


def random_model_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with CHATML_TEMPLATE as its chat template: what a model without model.path uses."""
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def load_tokenizer(model_cfg):
    """The tokenizer in model.tokenizer (a directory or hub id) when set, else in model.path's checkpoint (the
    directory build_model loads), else random_model_tokenizer."""
    if model_cfg.tokenizer:
        key, path = "model.tokenizer", resolve_checkpoint(model_cfg.tokenizer, "model.tokenizer", TOKENIZER_FILES)
    else:
        key, path = "model.path", resolve_model_path(model_cfg)
    if path is None:
        return random_model_tokenizer()
    from transformers import AutoTokenizer  # its auto classes took ~5 s of a job's imports on the H200's host

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # tokenizers and transformers raise many kinds for a broken file
        raise ConfigError(f"{key}: cannot load the tokenizer in {path} ({type(err).__name__}: {err})") from None

"""Tokenizers: a checkpoint's own, or a byte-level one (256 byte tokens + <|endoftext|>) for random models."""
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.config import ConfigError
from engine.models.loader import resolve_model_path

ENDOFTEXT = "<|endoftext|>"


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([ENDOFTEXT])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=ENDOFTEXT, pad_token=ENDOFTEXT)


def load_tokenizer(model_cfg):
    """The tokenizer of model.path's checkpoint (the directory build_model loads), else the byte-level one."""
    path = resolve_model_path(model_cfg)
    if path is None:
        return byte_level_tokenizer()
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # tokenizers and transformers raise many kinds for a broken file
        raise ConfigError(f"model.path: cannot load the tokenizer in {path} ({type(err).__name__}: {err})") from None

"""Tokenizers: a checkpoint's own, or a byte-level one (256 byte tokens + <|endoftext|>) for random models."""
from transformers import AutoTokenizer, PreTrainedTokenizerFast

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
    if model_cfg.path:
        return AutoTokenizer.from_pretrained(model_cfg.path)
    return byte_level_tokenizer()

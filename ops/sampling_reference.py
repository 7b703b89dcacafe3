"""Readable PyTorch versions of the sampling kernels (Triton versions: ops/sampling.py, and
ops/logprob_kernels.py for logprobs).

Sampling is Gumbel-max with counter-based noise: the scores of a row are, in float32,

    score_v = logits_v / T - log(-log(U(seed, step, v)))        (gumbel_scores; U: uniform_noise)

and a draw is the token of the best score (the first index among equal scores), which picks token v
with probability softmax(logits / T)_v. U depends only on (seed, step, token id), with seed and step
in [0, 2^32), so a request's tokens depend only on its seed, its output index and its logits.

    gumbel_sample(logits[B,V] float, temperature[B] f32 >= 0, seed[B] i64, step[B] i64) -> i64 [B]
        argmax_v score_v; a row at temperature 0 takes argmax_v logits_v.
    top_k_top_p_sample(logits, temperature, top_k[B] i64, top_p[B] f32, seed, step, min_p[B] f32 | None)
        -> i64 [B]: argmax over the kept set K (kept_mask) of the same scores; temperature 0: argmax logits.
    logprobs(logits[N,V] float, targets[N] i64, k) -> f32 [N, 2 + 2k]   (see logprobs)
    apply_penalties(logits[R,V] f32, token_ids[R,W], prompt_lens[R], num_tokens[R], repetition[R],
                    presence[R], frequency[R]) -> f32 [R,V]   (see apply_penalties; no kernel: torch ops)
    apply_token_bitmask(logits[B,V] float, bitmask[R,W] i32, rows[R] i64 | None) -> logits, in place:
        structured outputs' masks (see apply_token_bitmask)

The kept set K of a row is defined by logit values, so tokens of equal logit are kept or dropped
together (never split by their position in a sort). With l the logits read as float32,

    e_v = exp2((l_v - max l) * c),  c = log2(e) / T  (float32),    Z = sum_v e_v
    count(x) = |{j : l_j > x}|,   mass(x) = sum_{j : l_j > x} e_j
    K = {i : count(l_i) = 0  or  (count(l_i) < top_k  and  (top_p >= 1  or  mass(l_i) <= top_p * Z)
                                   and  e_i >= min_p)}

top_k >= V (or any count) keeps everything for top-k, top_p >= 1 skips the mass test, min_p = 0 the
last test (e_i is token i's probability over the most likely one's), and the top tie group is always
kept. Where every logit differs, K is the usual "k most likely tokens, then the smallest prefix of
mass >= top_p", less the tokens below min_p times the top probability: transformers' order (top-k,
top-p, min-p; min-p after a renormalisation is the same test). vLLM applies min-p first, so that top-p
then measures mass over the min-p survivors only; the two differ only in rows using both top_p and
min_p. K is an upper set: a token whose logit is >= a kept token's is kept.
The sums are float32 in both implementations, in different orders: they agree on K except where some
mass(l_i) lies within rounding (~1e-6 relative) of top_p * Z.
"""
import functools

import torch

_MASK32 = 0xFFFFFFFF
LOG2E = 1.4426950408889634
NOISE_BITS = 23  # bits of the uniform noise (uniform_from_bits)


def mix32(x):
    """A 32-bit integer hash, in int64 arithmetic that cannot overflow."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def uniform_from_bits(bits):
    """The midpoint of bin `bits` of 2^NOISE_BITS equal bins of (0, 1), as float32. bits + 1/2 needs
    NOISE_BITS + 1 significant bits, so NOISE_BITS = 23 keeps it exact: with 24 the top bin rounded to
    u = 1, a score of +inf."""
    return (bits.float() + 0.5) / float(1 << NOISE_BITS)


def uniform_noise(seed, step, token_ids):
    """Uniform (0, 1) values [B, V], a pure function of (seed[b], step[b], token_ids[b, v])."""
    key = mix32(mix32(seed) ^ step)
    return uniform_from_bits(mix32(key[:, None] ^ token_ids) >> (32 - NOISE_BITS))


def gumbel_scores(logits, temperature, seed, step, token_ids):
    """logits / T + Gumbel noise drawn for (seed, step, token id); its argmax is a sample."""
    return logits / temperature[:, None] - (-uniform_noise(seed, step, token_ids).log()).log()


def _scores(logits, temperature, seed, step):
    """(float32 logits, the scores of all tokens; rows at temperature 0 score by their logits)."""
    token_ids = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    logits, greedy = logits.float(), temperature == 0
    scores = gumbel_scores(logits, torch.where(greedy, 1.0, temperature), seed, step, token_ids)
    return logits, torch.where(greedy[:, None], logits, scores)


def gumbel_sample(logits, temperature, seed, step):
    return _scores(logits, temperature, seed, step)[1].argmax(dim=-1)


def kept_mask(logits, temperature, top_k, top_p, min_p=None):
    """K as a bool mask [B, V] (module docstring), for rows at temperature > 0; min_p None: 0."""
    logits = logits.float()
    c = LOG2E / torch.where(temperature > 0, temperature, 1.0)
    e = torch.exp2((logits - logits.max(dim=-1, keepdim=True).values) * c[:, None])
    z = e.sum(dim=-1, keepdim=True)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_e = e.gather(-1, order)
    mass_before = torch.cat([torch.zeros_like(z), sorted_e.cumsum(dim=-1)[:, :-1]], dim=-1)
    # count(l_i) is the sorted position where l_i's tie group starts; mass(l_i) the mass before it
    position = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    starts = torch.ones_like(sorted_logits, dtype=torch.bool)
    starts[:, 1:] = sorted_logits[:, 1:] != sorted_logits[:, :-1]
    count = torch.where(starts, position, 0).cummax(dim=-1).values
    mass = mass_before.gather(-1, count)
    min_p = torch.zeros_like(top_p) if min_p is None else min_p
    keep = (count == 0) | ((count < top_k[:, None]) & ((top_p[:, None] >= 1) | (mass <= top_p[:, None] * z))
                           & (sorted_e >= min_p[:, None]))
    return torch.zeros_like(keep).scatter(-1, order, keep)


def top_k_top_p_sample(logits, temperature, top_k, top_p, seed, step, min_p=None):
    logits, scores = _scores(logits, temperature, seed, step)
    kept = kept_mask(logits, temperature, top_k, top_p, min_p) | (temperature == 0)[:, None]
    return scores.masked_fill(~kept, float("-inf")).argmax(dim=-1)


def _ordered_bits(x):
    """int64 keys of float32 values with the same order (-0.0 and 0.0 equal): sign and magnitude
    bits to a signed integer."""
    bits = x.float().view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def logprobs(logits, targets, k):
    """The raw log-probabilities of a batch of logits rows, packed for one copy to the host: float32
    [N, 2 + 2k] holding, per row, log_softmax(logits)[target], the target's rank as int32 bits (1 + the
    tokens of a larger logit: vLLM's), then the k largest log-probabilities in descending order (ties: the
    smaller token id first), then those k token ids as int32 bits (ops.unpack_logprobs reads them). Entries
    beyond a row's finite logits are (-inf, id -1)."""
    x = logits.float()
    lse = x.logsumexp(dim=-1)
    out = torch.empty((x.shape[0], 2 + 2 * k), dtype=torch.float32, device=x.device)
    target = x.gather(-1, targets[:, None])
    out[:, 0] = target[:, 0] - lse
    out.view(torch.int32)[:, 1] = (x > target).sum(-1).int() + 1
    if k:
        ids = torch.arange(x.shape[-1], device=x.device)
        top_ids = (_ordered_bits(x) * 2**32 - ids).topk(k, dim=-1).indices  # value, then smaller id
        top = x.gather(-1, top_ids)
        out[:, 2:2 + k] = top - lse[:, None]
        out.view(torch.int32)[:, 2 + k:] = torch.where(top > float("-inf"), top_ids, -1).int()
    return out


def apply_penalties(logits, token_ids, prompt_lens, num_tokens, repetition, presence, frequency):
    """Row r's tokens are token_ids[r, :num_tokens[r]], its prompt the first prompt_lens[r] of them.
    Returns the logits (float32 [R, V]) with transformers' repetition penalty over prompt and output
    tokens (a seen token's logit divided by the penalty if positive, else multiplied by it), then
    OpenAI's presence and frequency penalties over output tokens (logit -= presence * (count > 0) +
    frequency * count). Counts come from a scatter_add into [R, V + 1] (column V takes the padding)."""
    R, V = logits.shape
    position = torch.arange(token_ids.shape[1], device=logits.device)
    in_prompt = position < prompt_lens[:, None]
    is_output = ~in_prompt & (position < num_tokens[:, None])
    ids = token_ids.long()
    counts = torch.zeros((R, V + 1), dtype=torch.int32, device=logits.device)
    counts.scatter_add_(1, torch.where(is_output, ids, V), is_output.int())
    seen = torch.zeros((R, V + 1), dtype=torch.bool, device=logits.device).scatter_(1, torch.where(in_prompt, ids, V), True)
    counts, seen = counts[:, :V], seen[:, :V] | (counts[:, :V] > 0)
    factor = torch.where(seen, repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Structured outputs' masks, in place: row rows[i] of logits [B, V] (any float dtype) keeps token t
    iff bit t % 32 of word t // 32 of bitmask[i] (int32 [R, W], on the logits' device; llguidance's
    layout) is 1, else becomes -inf; tokens t >= 32 * W are disallowed, bits for t >= V ignored, a NaN
    logit stays NaN. rows: int64 [R], distinct (None: R = B, row i is bitmask row i). Returns logits.

    Each byte of the words (read little-endian, as on every device torch runs on) picks a row of caps
    (_byte_caps) and the logits become min(logit, cap): a gather and a minimum, ~7x faster on the CPU
    than masked_fill with a mask of bools."""
    target = logits if rows is None else logits.index_select(0, rows)
    count, vocab = target.shape
    width = min(vocab, 32 * bitmask.shape[1])
    caps = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), _byte_caps(logits.device, logits.dtype))
    kept = target[:, :width]
    torch.minimum(kept, caps.view(count, -1)[:, :width], out=kept)
    if width < vocab:
        target[:, width:] = float("-inf")
    return logits if rows is None else logits.index_copy_(0, rows, target)


@functools.cache
def _byte_caps(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: row b holds, for bit k of byte b, +inf if the bit is 1 (min(x, +inf) = x) else -inf."""
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
    return torch.where(bits.bool(), float("inf"), float("-inf")).to(device=device, dtype=dtype)

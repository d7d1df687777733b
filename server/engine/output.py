"""Output: from a request's row of logits to its next token, its text, and whether it ends.

::

    logits row ──▶ logits hook (tests, evaluation) ──▶ [its constraint's mask] ──▶ sample (its own generator, its penalties
               over its prompt and output, or a forced token) ──▶ stop token / EOS / stop
               string / a complete grammar / max_tokens / the reserved capacity ──▶ TokenEvent

One row at a time: a row that raises fails its request only (each request draws from its own
generator, so batching never changed its tokens anyway). A plain greedy request (greedy and
nothing else: no hook, grammar, penalty, logprobs or forced token; :meth:`OutputProcessor.plain_greedy`)
skips the row: the runner picks its token on the device with the step's other such rows
(``sampling.greedy_ids``), and only that id reaches the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from server.engine.sampling import Sampled, sample
from server.engine.sequence import FinishReason, Sequence, TokenEvent


class OutputProcessor:
    """Samples rows and turns each token into the request's :class:`TokenEvent`."""

    def __init__(
        self, eos_token_ids: Iterable[int], logits_hook: Callable[[str, torch.Tensor], None] | None = None
    ) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.logits_hook = logits_hook

    def sample(self, seq: Sequence, row: torch.Tensor, masked: torch.Tensor | None = None) -> Sampled:
        """The next token of ``seq`` from its row of logits (raises on a failure of its own).
        ``masked``: the row with the tokens its constraint forbids at ``-inf``, which the token is
        chosen from; the logprobs stay those of the raw ``row``."""
        if self.logits_hook is not None:
            self.logits_hook(seq.request_id, row)
        n = seq.prompt_len
        history = [(seq.tokens[:n], seq.tokens[n:])] if seq.params.penalized else None
        if masked is None:
            return sample(row[None], [seq.params], [seq.generator], [_forced(seq)], tokens=history)[0]
        out = sample(masked[None], [seq.params], [seq.generator], [_forced(seq)], tokens=history)[0]
        if seq.params.logprobs is None:
            return out
        raw = sample(row[None], [replace(seq.params, temperature=0.0)], [None], [out.token_id], tokens=history)[0]
        return Sampled(out.token_id, raw.logprob, raw.top_logprobs)

    def plain_greedy(self, seq: Sequence) -> bool:
        """Whether ``seq``'s next token is its row's argmax and nothing reads the row: the runner
        may then choose it on the device (``sampling.greedy_ids``) instead of sending the row."""
        p = seq.params
        return (self.logits_hook is None and p.greedy and not p.penalized and p.logprobs is None
                and seq.matcher is None and seq.num_generated >= len(p.forced_tokens))

    def emit(self, seq: Sequence, out: Sampled, finish: Callable[[Sequence, FinishReason], TokenEvent]) -> TokenEvent:
        """Append the sampled token; ``finish`` ends the request when a stop rule fires."""
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if seq.matcher is not None:  # a token its grammar refuses (a forced one) raises: it fails alone
            seq.matcher.consume(out.token_id)
        seq.tokens.append(out.token_id)
        p = seq.params
        reason = None
        eos = out.token_id in self.eos_token_ids
        if out.token_id in p.stop_token_ids or (eos and (not p.ignore_eos or seq.matcher is not None)):
            reason, text = FinishReason.STOP, seq.text.finish()
        else:
            text = seq.text.push(out.token_id)
            if seq.text.stopped:
                reason = FinishReason.STOP
            elif seq.matcher is not None and seq.matcher.stopped:  # the grammar is complete
                reason, text = FinishReason.STOP, text + seq.text.finish()
            elif seq.num_generated >= p.max_tokens or len(seq.tokens) >= seq.capacity:
                reason, text = FinishReason.LENGTH, text + seq.text.finish()
        event = TokenEvent(seq.request_id, out.token_id, text, out.logprob, out.top_logprobs)
        if reason is None:
            return event
        end = finish(seq, reason)
        return TokenEvent(seq.request_id, out.token_id, text, out.logprob, out.top_logprobs, reason, end.usage,
                          timeline=end.timeline)


def _forced(seq: Sequence) -> int | None:
    forced = seq.params.forced_tokens
    return forced[seq.num_generated] if seq.num_generated < len(forced) else None

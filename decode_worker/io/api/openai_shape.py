"""The OpenAI response objects (completions and chat) of one request's samples.

Choice `k` is sample k (`samples.py`: prompt `k // n`, its sample `k % n`). `usage` counts every
prompt once (the samples of one prompt share it) and every sample's completion tokens. A chat
whose output is parsed (`parsing`: harmony) gets its message and deltas from `harmony/chat.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from decode_worker.core.sampling import TopLogprobs
from decode_worker.io.api.common import (
    SSE_DONE,
    cached_tokens_details,
    error_obj,
    now_s,
    sse,
)
from decode_worker.io.api.harmony.chat import ChatParsing, ChatStream, chat_message, finish_reason
from decode_worker.io.api.run import Finish, GenerationRun, Step
from decode_worker.io.api.samples import merged_steps


class OpenAIShape:
    """Builds the OpenAI response objects of a request's runs (one per sample)."""

    def __init__(self, model: str, runs: Sequence[GenerationRun], n: int, chat: bool,
                 parsing: ChatParsing | None = None, *, cache_details: bool = False) -> None:
        self.model, self.runs, self.n, self.chat = model, list(runs), n, chat
        self.cache_details = cache_details  # SGLang's `return_cached_tokens_details`
        self.parsing = parsing if chat else None
        rid = runs[0].inp.extra.get("client_rid", runs[0].inp.rid)
        self.id = f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"
        self.created = now_s()
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = f"{self.object}.chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage(self) -> dict[str, Any]:
        firsts = self.runs[::self.n]  # the first sample of each prompt
        prompt = sum(run.prompt_tokens for run in firsts)
        done = sum(len(run.output_ids) for run in self.runs)
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}

    def sglext(self) -> dict[str, Any] | None:
        """SGLang's response-level extension when `return_cached_tokens_details` was asked for
        and something was cached: `{"cached_tokens_details": {"device", "host"}}` of the first
        sample (SGLang takes the request's first result too); else None."""
        if not self.cache_details:
            return None
        run = self.runs[0]
        details = cached_tokens_details(run.cached_tokens, run.host_cached_tokens)
        return {"cached_tokens_details": details} if details is not None else None

    def logprobs(self, k: int, ids: list[int], lps: list[float],
                 tops: list[TopLogprobs]) -> dict[str, Any] | None:
        """OpenAI's logprobs object of sample k's `ids` (and their alternatives if asked for)."""
        run = self.runs[k]
        if not run.inp.return_logprob:
            return None
        tok = run.backend.tokenizer
        tokens = [tok.decode([t]) for t in ids]
        alts = [[(tok.decode([t]), lp) for t, lp in top] for top in tops] or [[]] * len(ids)
        if self.chat:
            return {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                  for a, alp in alt]}
                for t, lp, alt in zip(tokens, lps, alts, strict=False)]}
        top_dicts = [dict(alt) for alt in alts] if run.inp.top_logprobs else None
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_dicts,
                "text_offset": []}

    def choice(self, k: int, text: str, fin: Finish | None, lp: dict[str, Any] | None,
               delta: bool) -> dict[str, Any]:
        reason = fin.reason if fin is not None else None
        out: dict[str, Any] = {"index": k, "logprobs": lp, "finish_reason": reason,
                               "matched_stop": fin.matched if fin is not None else None}
        if not self.chat:
            out["text"] = text
        elif delta:
            out["delta"] = {"content": text} if text or fin is None else {}
        else:
            out["message"] = {"role": "assistant", "content": text}
        return out

    def full(self) -> dict[str, Any]:
        choices = []
        for k, run in enumerate(self.runs):
            lp = self.logprobs(k, run.output_ids, run.logprobs, run.top_logprobs)
            choice = self.choice(k, run.text.text, run.finish, lp, delta=False)
            if self.parsing is not None:
                sp = run.inp.sampling
                choice["message"], calls = chat_message(run.output_ids, self.parsing,
                                                        run.backend.tokenizer, sp.stop,
                                                        sp.no_stop_trim)
                choice["finish_reason"] = finish_reason(choice["finish_reason"], calls)
            choices.append(choice)
        body = self._envelope(choices, False)
        body["usage"] = self.usage()
        ext = self.sglext()
        if ext is not None:
            body["sglext"] = ext
        return body

    def chunk(self, choice: dict[str, Any] | None, usage: bool = False,
              sglext: dict[str, Any] | None = None) -> bytes:
        body = self._envelope([choice] if choice is not None else [], True)
        if usage:
            body["usage"] = self.usage()
        if sglext is not None:
            body["sglext"] = sglext
        return sse(body)


class _Pending:
    """Sample k's tokens (and logprobs) not yet sent: their text is still held back."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.tops: list[TopLogprobs] = []

    def add(self, step: Step) -> None:
        self.ids += step.token_ids
        self.lps += step.logprobs
        self.tops += step.top_logprobs

    def take(self, shape: OpenAIShape, k: int) -> dict[str, Any] | None:
        lp = shape.logprobs(k, self.ids, self.lps, self.tops)
        self.ids, self.lps, self.tops = [], [], []
        return lp


async def stream_chunks(shape: OpenAIShape, include_usage: bool) -> AsyncGenerator[bytes, None]:
    """The SSE body: (chat) a role chunk per choice, a chunk per text delta of any choice, its
    finish chunk, the `sglext` chunk and the usage chunk when asked for, then [DONE]; an error
    ends it early."""
    if shape.chat:
        for k in range(len(shape.runs)):
            first = shape.choice(k, "", None, None, delta=True)
            first["delta"] = {"role": "assistant", "content": ""}
            yield shape.chunk(first)
    pending = [_Pending() for _ in shape.runs]
    parsed = [ChatStream(shape.parsing, run.backend.tokenizer, run.inp.sampling.stop,
                         run.inp.sampling.no_stop_trim) for run in shape.runs] if (
        shape.parsing is not None) else None
    async with contextlib.aclosing(merged_steps(shape.runs)) as steps:
        async for k, step in steps:
            fin = step.finish
            if fin is not None and fin.reason == "error":
                yield sse(error_obj(fin.message or "internal error", fin.status, fin.code))
                yield SSE_DONE
                return
            pending[k].add(step)
            if parsed is not None:
                chunk = _parsed_chunk(shape, k, step, parsed[k], pending[k])
                if chunk is not None:
                    yield chunk
            elif step.text or fin is not None:
                yield shape.chunk(shape.choice(k, step.text, fin, pending[k].take(shape, k),
                                               delta=True))
    ext = shape.sglext()
    if ext is not None:  # as SGLang: its own chunk, no choices
        yield shape.chunk(None, sglext=ext)
    if include_usage:
        yield shape.chunk(None, usage=True)
    yield SSE_DONE


def _parsed_chunk(shape: OpenAIShape, k: int, step: Step, stream: ChatStream,
                  pending: _Pending) -> bytes | None:
    """Sample k's chunk for a step of a parsed (harmony) chat, or None when it added nothing
    visible yet (its tokens' logprobs then wait for the next chunk)."""
    fin = step.finish
    delta = stream.delta(step.token_ids, last=fin is not None)
    if not delta and fin is None:
        return None
    choice = shape.choice(k, "", fin, pending.take(shape, k), delta=True)
    choice["delta"] = delta
    choice["finish_reason"] = finish_reason(choice["finish_reason"], stream.made_calls)
    return shape.chunk(choice)

"""`GenerateRequest` -> the HTTP `/generate` body's parts, and a run's steps -> responses.

A gRPC request is read into the same types the HTTP route decodes (`SamplingIn`,
`Bootstrap`), so it goes through the same checks (`schemas.sampling_from_generate`,
`targets.sample_targets`, `refuse_extra_outputs`). proto3 cannot tell an unset scalar from
its zero: as SGLang's servicer reads them, top_p 0, top_k 0 and repetition_penalty 0 mean
"unset" (1.0, -1, 1.0), `n` 0 means 1; `temperature` 0 is greedy (smg always sets it).

Responses follow SGLang's servicer: a stream sends one `GenerateStreamChunk` per step with
the step's new token ids (and their logprobs), then a `GenerateComplete` after the last one
carrying that last step's ids; a non-streaming call sends one `GenerateComplete` per sample
with every output id. Counts are cumulative; `index` is the sample (n > 1). `cached_tokens` has
no device/host split here: smg's proto (smg-grpc-proto 0.4.28) has no field for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from decode_worker.core.sampling import TopLogprobs
from decode_worker.errors import ClientError
from decode_worker.io.api.run import GenerationRun, Step
from decode_worker.io.api.schemas import Bootstrap, SamplingIn, refuse_extra_outputs


def prompt_ids(req: pb.GenerateRequest) -> list[int]:
    """The prompt's token ids (unchecked: `common.check_prompt` checks them). Raises
    ClientError for inputs this worker does not take (no prompt ids, images, embeddings,
    LoRA adapters)."""
    if not req.HasField("tokenized"):
        raise ClientError("tokenized input must be provided (GenerateRequest.tokenized)")
    if req.HasField("mm_inputs"):
        raise ClientError("multimodal inputs are not supported: this model takes text only")
    if req.input_embeds:
        raise ClientError("input_embeds are not supported: send tokenized.input_ids")
    if req.lora_id:
        raise ClientError(f"lora_id={req.lora_id[:80]!r}: this worker serves no LoRA adapters")
    if req.token_ids_logprob:
        raise ClientError("token_ids_logprob is not supported (use top_logprobs_num)")
    return list(req.tokenized.input_ids)


def sampling_in(p: pb.SamplingParams) -> SamplingIn:
    """The HTTP `sampling_params` these gRPC sampling parameters stand for. Raises ClientError
    for a structural tag (not served) or a negative stream interval."""
    constraint = p.WhichOneof("constraint")
    if constraint == "structural_tag":
        raise ClientError("structural_tag is not supported (use json_schema, regex or "
                          "ebnf_grammar)")
    if p.HasField("stream_interval") and p.stream_interval < 0:
        raise ClientError(f"stream_interval={p.stream_interval}: must be >= 0")
    return SamplingIn(
        max_new_tokens=p.max_new_tokens if p.HasField("max_new_tokens") else None,
        temperature=p.temperature,
        top_p=p.top_p if p.top_p != 0.0 else None,
        top_k=p.top_k if p.top_k != 0 else None,
        min_p=p.min_p,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        ignore_eos=p.ignore_eos,
        no_stop_trim=p.no_stop_trim,
        skip_special_tokens=p.skip_special_tokens,
        n=p.n or 1,
        json_schema=p.json_schema if constraint == "json_schema" else None,
        regex=p.regex if constraint == "regex" else None,
        ebnf=p.ebnf_grammar if constraint == "ebnf_grammar" else None,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0.0 else None,
        logit_bias=dict(p.logit_bias) or None,
        min_new_tokens=p.min_new_tokens,
    )


def bootstrap(req: pb.GenerateRequest) -> Bootstrap:
    """`DisaggregatedParams` as the HTTP body's bootstrap fields (none when absent; the room
    may be 0). Raises ClientError for hidden states (not produced here)."""
    boot = Bootstrap(return_hidden_states=req.return_hidden_states)
    refuse_extra_outputs(boot)
    if not req.HasField("disaggregated_params"):
        return boot
    dp = req.disaggregated_params
    boot.bootstrap_host = dp.bootstrap_host or None
    boot.bootstrap_port = dp.bootstrap_port or None
    boot.bootstrap_room = dp.bootstrap_room
    return boot


def output_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[TopLogprobs]
) -> pb.OutputLogProbs:
    return pb.OutputLogProbs(
        token_logprobs=list(logprobs), token_ids=list(token_ids),
        top_logprobs=[pb.TopLogProbs(values=[lp for _, lp in top],
                                     token_ids=[tid for tid, _ in top]) for top in tops])


def chunk(rid: str, run: GenerationRun, step: Step, index: int) -> pb.GenerateResponse:
    """One streamed step: its new token ids, cumulative counts."""
    msg = pb.GenerateStreamChunk(
        token_ids=step.token_ids, prompt_tokens=run.prompt_tokens,
        completion_tokens=len(run.output_ids), cached_tokens=run.cached_tokens, index=index)
    if run.inp.return_logprob:
        msg.output_logprobs.CopyFrom(
            output_logprobs(step.token_ids, step.logprobs, step.top_logprobs))
    return pb.GenerateResponse(request_id=rid, chunk=msg)


def complete(rid: str, run: GenerationRun, index: int, last: Step | None) -> pb.GenerateResponse:
    """A finished sample: `last` (streams) carries the last step's ids, else every output id."""
    fin = run.finish
    ids = last.token_ids if last is not None else run.output_ids
    msg = pb.GenerateComplete(
        output_ids=ids, finish_reason=fin.reason if fin is not None else "abort",
        prompt_tokens=run.prompt_tokens, completion_tokens=len(run.output_ids),
        cached_tokens=run.cached_tokens, index=index)
    if run.spec is not None and run.spec.proposed_drafts:
        msg.spec_accepted_tokens = run.spec.correct_drafts
        msg.spec_draft_tokens = run.spec.proposed_drafts
    matched = fin.matched if fin is not None else None
    if isinstance(matched, bool) or matched is None:
        pass
    elif isinstance(matched, int):
        msg.matched_token_id = matched
    else:
        msg.matched_stop_str = matched
    if run.inp.return_logprob:
        lps = output_logprobs(ids, last.logprobs, last.top_logprobs) if last is not None else \
            output_logprobs(run.output_ids, run.logprobs, run.top_logprobs)
        msg.output_logprobs.CopyFrom(lps)
    return pb.GenerateResponse(request_id=rid, complete=msg)

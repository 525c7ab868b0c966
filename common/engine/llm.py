"""Offline Python API in the spirit of vLLM: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sequence import FinishReason
from common.protocol.messages import PromptLogprobs
from common.protocol.sampling_params import SamplingParams
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import apply_chat_template

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # when the sampling params asked
    # With speculation on: `SpecStats.to_dict()` (drafts, drafted and accepted tokens, mean
    # accepted length), the same entry as the server's timing record's `spec_decode`
    spec_decode: dict[str, float | int] | None = None


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (`tp > 1`); a no-op with one rank."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token-id prompts")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or token ids
        params = sampling_params or SamplingParams()
        params_list = (
            [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        return self._run([self.encode(p) for p in prompts], params_list)

    def chat(
        self,
        conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [apply_chat_template(self.tokenizer, conv) for conv in conversations]
        return self.generate(prompts, sampling_params)

    def _run(
        self, prompt_ids: list[list[int]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        order = []
        for ids, p in zip(prompt_ids, params, strict=True):
            rid = f"llm-{next(self._ids)}"
            seq = self.engine.add_request(rid, ids, p)
            order.append(rid)
            outputs[rid] = RequestOutput(rid, ids)
            if self.tokenizer is not None:
                detoks[rid] = IncrementalDetokenizer(
                    self.tokenizer, ids, p.stop, min_tokens=p.min_tokens
                )
        while self.engine.has_unfinished():
            for event in self.engine.step():
                seq, out = event.seq, outputs[event.seq.request_id]
                detok = detoks.get(seq.request_id)
                if detok is not None:
                    out.text += detok.add(event.new_token_ids)
                    if detok.stopped_on is not None and not event.finished:
                        self.engine.abort(seq.request_id, FinishReason.STOP)
                    if event.finished or detok.stopped_on is not None:
                        out.text += detok.flush()
                if event.finished or seq.is_finished:
                    self._finish(out, seq)
        return [outputs[rid] for rid in order]

    def _finish(self, out: RequestOutput, seq) -> None:
        out.token_ids = list(seq.output_token_ids)
        out.finish_reason = seq.finish_reason.value if seq.finish_reason else None
        out.num_cached_tokens = seq.num_cached_tokens
        out.prompt_logprobs = seq.prompt_logprobs()
        if self.engine.config.speculative.enabled:
            out.spec_decode = seq.spec.to_dict()
        if seq.params.logprobs is not None:
            out.logprobs = list(seq.output_logprobs)
            out.top_logprobs = list(seq.output_top_logprobs)

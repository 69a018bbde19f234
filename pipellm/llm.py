"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pipellm.config import EngineConfig
from pipellm.engine.core import EngineCore
from pipellm.engine.outputs import CompletionOutput, RequestOutput
from pipellm.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Runs the engine in this process (its pipeline stages, if any, in their own)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self._start(EngineConfig(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, ids, params)
                text = prompt if isinstance(prompt, str) else None
                samples = [CompletionOutput(i, "", []) for i in range(params.n)]
                results[request_id] = RequestOutput(request_id, text, ids, samples)
        except BaseException:
            for request_id in results:  # a bad prompt cancels the whole call
                self.engine.abort_request(request_id)
            raise
        self._run(results, use_tqdm)
        return list(results.values())

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        progress = tqdm(total=len(results), desc="Generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    result = results[out.request_id]
                    completion = result.outputs[out.index]
                    completion.text += out.new_text
                    completion.token_ids.extend(out.new_token_ids)
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                    if out.new_logprobs:
                        completion.logprobs = (completion.logprobs or []) + out.new_logprobs
                    if out.finished:
                        completion.finish_reason = out.finish_reason
                        completion.stop_reason = out.stop_reason
                    if out.request_finished:
                        result.finished = True
                        result.num_cached_tokens = out.num_cached_tokens
                        progress.update(1)
        except BaseException:
            for request_id, result in results.items():
                if not result.finished:
                    self.engine.abort_request(request_id)
            raise
        finally:
            progress.close()

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Applies the chat template to one conversation or a list of them: `chat_template`
        (the template's text, as vLLM's LLM.chat takes it) or else the model's own."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(c, True, chat_template=chat_template),
                add_special_tokens=False,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

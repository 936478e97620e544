"""The vLLM-compatible offline API: LLM(model=...).generate(prompts, SamplingParams(...))."""

from collections.abc import Sequence

from tqdm.auto import tqdm

from mlaserve.config.engine_config import EngineConfig
from mlaserve.engine.heap import start_up_objects_frozen
from mlaserve.engine.llm_engine import LLMEngine
from mlaserve.outputs import RequestOutput
from mlaserve.sampling_params import SamplingParams

Prompt = str | dict


class LLM:
    def __init__(self, model: str | None = None, **engine_options: object) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))

    def get_tokenizer(self) -> object:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # Validate everything first: one bad prompt rejects the call before any request is queued.
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                prepared.append(self.engine.prepare(prompt, p))
            except (ValueError, TypeError) as e:
                # a subclass (GrammarError) leaves as the base class, which takes the one message
                raise (TypeError if isinstance(e, TypeError) else ValueError)(f"prompt {i}: {e}") from None
        ids = [self.engine.add_prepared(p) for p in prepared]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict]) -> dict:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass plain prompts to generate()")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        with start_up_objects_frozen():
            try:
                while len(results) < len(request_ids) and self.engine.has_unfinished_requests():
                    for out in self.engine.step(stream=False):
                        if out.finished and out.request_id in wanted:
                            results[out.request_id] = out
                            bar.update(1)
            except BaseException:
                # An interrupted call leaves no request (and no block) behind.
                for rid in wanted - results.keys():
                    self.engine.abort_request(rid)
                raise
            finally:
                bar.close()
        return [results[rid] for rid in request_ids]

    def stats(self) -> dict:
        return self.engine.stats()

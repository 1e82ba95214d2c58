"""`LLM`: the offline, vLLM-shaped API. Give it all the prompts; it batches them continuously."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tqdm.auto import tqdm

from paged_backend.config import EngineConfig
from paged_backend.engine import LLMEngine, PromptType, check_priority, truncate_prompt
from paged_backend.outputs import RequestOutput
from paged_backend.prompt_dicts import prompt_source, salted
from paged_backend.sampling_params import SamplingParams

Conversation = list[dict]


class LLM:
    """`LLM(model=None)` runs the embedded default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def get_tokenizer(self):
        """The model's transformers tokenizer (loaded now if no chat loaded it before)."""
        return self.engine.tokenizer.hf

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's prompt dicts:
        `paged_backend.prompt_dicts`); outputs come back in prompt order."""
        if isinstance(prompts, Mapping):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise TypeError(
                "prompts must be a str, a list of token ids, a prompt dict, or a list of "
                f"those, got {type(prompts).__name__}"
            )
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sources = [prompt_source(p) for p in prompts]
        token_ids = [self.engine.tokenize(source) for source, _, _ in sources]
        texts = [text for _, text, _ in sources]
        salts = [salt for _, _, salt in sources]
        return self._run(texts, token_ids, sampling_params, use_tqdm, priority, salts)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        texts = [
            self.engine.apply_chat_template(
                list(conv),
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            for conv in messages
        ]
        token_ids = [self.engine.tokenize(t, add_special_tokens=False) for t in texts]
        return self._run(texts, token_ids, sampling_params, use_tqdm, None)

    def _run(
        self, texts, token_ids, sampling_params, use_tqdm, priority, salts=None
    ) -> list[RequestOutput]:
        n = len(token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * n
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        if salts is not None:  # prompt dicts' cache salts
            params = [salted(p, salt) for p, salt in zip(params, salts, strict=True)]
        if priority is not None and not isinstance(priority, Sequence):
            raise TypeError(f"priority must be a list of ints, got {type(priority).__name__}")
        priorities = list(priority) if priority is not None else [0] * n
        if len(priorities) != n:
            raise ValueError(f"priority has {len(priorities)} entries for {n} prompts")
        for i, (p, prio) in enumerate(zip(params, priorities, strict=True)):
            check_priority(prio)  # every request is checked before any work starts
            token_ids[i] = truncate_prompt(token_ids[i], p, self.engine.max_model_len)
            self.engine.validate(token_ids[i], p)
        ids = [
            self.engine.add_request(text, p, prompt_token_ids=tok, priority=prio)
            for text, tok, p, prio in zip(texts, token_ids, params, priorities, strict=True)
        ]
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=n, desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(results) < n and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        failed = [o for o in results.values() if o.error]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [results[i] for i in ids]

    def stats(self) -> dict:
        return self.engine.stats()

"""LLM: the offline engine. Generate for a batch of prompts, synchronously.

    llm = LLM()                                   # the embedded default model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=32))
"""
import itertools
from typing import Optional, Sequence, Union

from tqdm import tqdm

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import InvalidRequestError
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.processor import Processor, PromptType, load_tokenizer
from engine.protocol import EngineCoreRequest
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.scheduler import SchedulerStats

ParamsArg = Union[None, SamplingParams, Sequence[SamplingParams]]


class LLM:
    """Offline engine. `model=None` loads the embedded default (SmolLM2-135M-Instruct); other
    keyword arguments are EngineConfig fields (dtype, max_num_seqs, max_model_len, ...)."""

    def __init__(self, model: Optional[str] = None, **config):
        self.config = EngineConfig(model=model, **config)
        self.core = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config)
        self.processor = Processor(self.config, self.tokenizer, self.core.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]], sampling_params: ParamsArg = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts: strings, token-id lists, or dicts
        with 'prompt' / 'prompt_token_ids'. Raises InvalidRequestError (a ValueError) before
        running anything if any prompt or parameter is bad."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        processed = [self.processor.process(p, sp) for p, sp in zip(prompts, params)]
        request_ids = []
        try:
            for (text, token_ids), sp in zip(processed, params):
                request_ids.append(self._add_request(text, token_ids, sp))
            return self._run(request_ids, use_tqdm and len(request_ids) > 1)
        except BaseException:
            self._abort(request_ids)
            raise

    def chat(self, conversations, sampling_params: ParamsArg = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies for one conversation (a list of message dicts) or a list of them,
        templated by the tokenizer's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.processor.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add_request(self, text: Optional[str], token_ids: list[int], params: SamplingParams) -> str:
        rid = str(next(self._ids))
        children = [rid] if params.n == 1 else [f"{rid}-{i}" for i in range(params.n)]
        self.output_processor.add_request(rid, text, token_ids, params.clone(output_kind=RequestOutputKind.FINAL_ONLY),
                                          children)
        for i, cid in enumerate(children):
            child = params if params.n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            self.core.add_request(EngineCoreRequest(cid, token_ids, child, self.processor.eos_token_id))
        return rid

    def _run(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", dynamic_ncols=True) if show_progress else None
        while self.output_processor.has_unfinished():
            outputs = self.core.step()
            ready, to_abort = self.output_processor.process_outputs(outputs)
            if to_abort:
                self.core.abort_requests(to_abort)
            for _, out in ready:
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in request_ids]

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.abort(rid))

    # ---- control and introspection ----------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    @property
    def weight_version(self) -> int:
        return self.core.weight_version

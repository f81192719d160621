"""``transformers.generate`` behind the rollout engine's ``generate`` interface, for 4-bit models.

tidal's engine holds bf16/fp16/fp32 weights and has no 4-bit kernels, so ``tidal chat --load_in_4bit``
(OpenRLHF's interactive_chat flag) loads the model with bitsandbytes NF4 through transformers and
samples with ``model.generate``. ``HFGenerator`` offers what a chat session uses of ``LLMEngine``:
``tokenizer``, ``max_model_len`` and ``generate(prompts, params)`` returning ``RequestOutput``\\ s with
the same sampling settings (temperature, top-p, top-k, min-p, repetition penalty, max new tokens, stop
tokens). It is slower than the engine; it exists for models that only fit in 4 bits.
"""

from __future__ import annotations

import torch

from tidal.rollout.outputs import CompletionOutput, RequestOutput
from tidal.rollout.sampling_params import SamplingParams


class HFGenerator:
    """A 4-bit (NF4) transformers model with the slice of ``LLMEngine``'s interface chat needs."""

    def __init__(self, path: str, tokenizer, seed: int, device: str | None = None):
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        compute = torch.bfloat16 if device.startswith("cuda") else torch.float32  # as the engine's "auto"
        quant = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute
        )
        self.model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=quant, device_map=device
        ).eval()
        self.tokenizer = tokenizer
        self.max_model_len = int(self.model.config.max_position_embeddings)
        self.device = torch.device(device)
        self.seed = seed
        self._calls = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        outputs = []
        for index, prompt in enumerate(prompts):
            # One seed per call, so a chat's replies are reproducible but not all the same draw.
            torch.manual_seed(self.seed + self._calls)
            self._calls += 1
            ids = torch.tensor([prompt], device=self.device)
            with torch.inference_mode():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), **generate_kwargs(params, self.tokenizer)
                )
            tokens = out[0, len(prompt) :].tolist()
            tokens, reason = _cut_at_stop(tokens, params, self.tokenizer)
            text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
            text, reason = _cut_at_stop_string(text, reason, params)
            completion = CompletionOutput(0, text, tokens, [], reason)
            outputs.append(RequestOutput(index, None, list(prompt), [completion], True))
        return outputs


def generate_kwargs(params: SamplingParams, tokenizer) -> dict:
    """``model.generate`` arguments with the engine's sampling semantics (temperature 0: greedy)."""
    kwargs = {"max_new_tokens": params.max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if params.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = params.repetition_penalty
    if params.temperature == 0:
        return {**kwargs, "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=None)
    if params.top_k > 0:
        kwargs["top_k"] = params.top_k
    if params.min_p > 0:
        kwargs["min_p"] = params.min_p
    return kwargs


def _cut_at_stop(tokens: list[int], params: SamplingParams, tokenizer) -> tuple[list[int], str]:
    """The tokens up to (not including) the first end-of-sequence or stop token, and why they end."""
    stops = set(params.stop_token_ids or ())
    if not params.ignore_eos and tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i], "stop"
    return tokens, "length"


def _cut_at_stop_string(text: str, reason: str, params: SamplingParams) -> tuple[str, str]:
    """``text`` up to its earliest stop string (kept with ``include_stop_str_in_output``)."""
    found = [(text.find(stop), stop) for stop in params.stop if stop and stop in text]
    if not found:
        return text, reason
    at, stop = min(found)
    return text[: at + len(stop) if params.include_stop_str_in_output else at], "stop"

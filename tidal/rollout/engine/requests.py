"""How ``LLMEngine`` turns requests into sequences and sequences into outputs: each prompt's ids checked
against the model (and a vision family's image markers expanded as transformers' processor does:
``tidal.data.vision.expand_request_images``), the ``n`` samples of a request
made into ``Sequence``s with their seeds, and the ``CompletionOutput`` / ``RequestOutput`` of finished or
running samples (text cut at the stop strings)."""

from __future__ import annotations

from functools import cached_property, partial

import numpy as np

from tidal.data.vision import expand_request_images
from tidal.rollout.outputs import CompletionOutput, RequestOutput
from tidal.rollout.runner.multimodal import MultiModalInput, PromptImages, prepare_images
from tidal.rollout.runner.sampler import sequence_seed
from tidal.rollout.sampling_params import SamplingParams
from tidal.rollout.scheduling.block_manager import blocks_needed
from tidal.rollout.scheduling.sequence import Sequence


class RequestBuilding:
    """``LLMEngine``'s request side (a mixin: it reads the engine's tokenizer, model, config, cache size and
    request counters)."""

    def _params_per_prompt(self, num_prompts: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts")
        return list(sampling_params)

    def _encode(self, index: int, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt {index} is a string but the engine has no tokenizer; pass token ids"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        vocab = self.model.args.vocab_size
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                "(the prompt must leave room for at least one new token)"
            )
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt {index} has token ids outside [0, {vocab})")
        return ids

    def _encode_with_images(self, index: int, prompt, mm: MultiModalInput | None):
        """The prompt's ids (image placeholders expanded) and its ``PromptImages`` (None: text only)."""
        ids = self._encode(index, prompt)
        if mm is None or mm.num_images == 0:
            if self.vision is not None and self.vision.image_token_id in ids:
                raise ValueError(f"request {index}: the prompt has image placeholder tokens but no images")
            return ids, None
        if self.vision is None:
            raise ValueError(f"request {index} has images but the model has no vision tower")
        ids, images = prepare_images(
            index, ids, mm, self.vision, self.image_processor, partial(self._image_ids, prompt)
        )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens with its image tokens but max_model_len is "
                f"{self.max_model_len} (the prompt must leave room for at least one new token)"
            )
        return ids, images

    @cached_property
    def image_layout(self):
        """The family's processor layout of images (``tidal.data.vision.VisionProcessor`` with its
        ``ImageMarkup``; ``tidal serve`` lays chat images out with it); None for a text model, or without a
        tokenizer (the image token alone is expanded then)."""
        if self.tokenizer is None or self.vision is None:
            return None
        from tidal.data.vision import VisionProcessor, image_markup

        markup = image_markup(self.hf_config, self.tokenizer)
        return VisionProcessor(self.tokenizer, None, self.vision.image_token_id, markup=markup)

    def _image_ids(self, prompt, ids: list[int], counts: list[int]) -> list[int]:
        """``ids`` (of ``prompt``) with images laid out as transformers' processor does. A text prompt
        with markers is expanded on its text, then encoded, as the processor does: a tokenizer may merge
        Gemma 3's added newlines with a neighbouring one (Gemma's has one token for ``\\n\\n\\n``)."""
        layout = self.image_layout
        if layout is None:
            return expand_request_images(ids, counts, self.vision.image_token_id)
        expanded = layout.request_ids(ids, counts)
        if isinstance(prompt, str) and expanded != ids:
            return self.tokenizer.encode(layout.image_markup.expand_text(prompt, counts))
        return expanded

    def _make_group(
        self, index: int, ids: list[int], params: SamplingParams, mm: PromptImages | None = None
    ) -> list[Sequence]:
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"request {index}: n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"request {index}: stop strings need a tokenizer")
        bs = self.config.block_size
        longest = min(len(ids) + params.max_new_tokens, self.max_model_len)
        need = max(self.block_manager.group_blocks_needed(len(ids), params.n), blocks_needed(longest, bs))
        if need > self.num_kv_blocks:
            raise ValueError(
                f"request {index} needs {need} KV blocks (prompt {len(ids)} tokens, n={params.n}, "
                f"max_new_tokens={params.max_new_tokens}) but the cache has {self.num_kv_blocks} (raise "
                f"gpu_memory_utilization (--vllm_gpu_memory_utilization) or num_kv_blocks, or lower "
                f"max_num_seqs: a linear-attention model's recurrent states per sequence slot come out "
                f"of the same memory)"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        group = []
        for sample in range(params.n):
            group.append(Sequence(self._next_seq_id, index, sample, ids, params, sequence_seed(seed, sample)))
            group[-1].mm = mm  # the n samples share the prompt's images (and its one prefill)
            self._next_seq_id += 1
        return group

    def _detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = ""
        if self.tokenizer is not None:
            text = self._detokenize(seq.output_token_ids, seq.params.skip_special_tokens)
            text = cut_at_stop(text, seq.params)
        return CompletionOutput(
            index=seq.sample_index,
            text=text,
            token_ids=seq.output_token_ids,
            logprobs=list(seq.output_logprobs),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            routed_experts=None if seq.routing is None else np.stack(seq.routing[: seq.num_tokens - 1]),
            top_logprobs=copy_list(seq.output_top_logprobs),
        )

    def _snapshot(self, request_id: int) -> RequestOutput:
        group = self._requests[request_id]
        finished = all(seq.is_finished for seq in group)
        outputs = [
            self._completion(seq)
            if finished
            else CompletionOutput(
                seq.sample_index,
                "",
                seq.output_token_ids,
                list(seq.output_logprobs),
                None,
                top_logprobs=copy_list(seq.output_top_logprobs),
            )
            for seq in group
        ]
        return RequestOutput(
            request_id, None, group[0].token_ids[: group[0].num_prompt_tokens], outputs, finished
        )


def copy_list(items: list | None) -> list | None:
    """A snapshot of a growing per-token list (None stays None)."""
    return None if items is None else list(items)


def cut_at_stop(text: str, params: SamplingParams) -> str:
    hits = [(text.find(s), s) for s in params.stop if s in text]
    if not hits:
        return text
    index, stop = min(hits)
    return text[: index + len(stop)] if params.include_stop_str_in_output else text[:index]

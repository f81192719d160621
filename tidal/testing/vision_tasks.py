"""A synthetic visual task whose answer is only in the image, and greedy evaluation of a tiny VLM on it.

``ColourTask`` draws a coloured square (red, green or blue, jittered in shade, size and place) on a grey
background and asks "What colour is the square?"; the answer is the colour's name. The prompt text is
the same for every row, so a model that does not see the image can do no better than chance (1/3).
``write_jsonl`` writes the PNGs beside the data file and rows in OpenRLHF's format, the image paths
relative to the file; ``with_images=False`` writes the same rows without images (the control).

``greedy_answers`` decodes with ``transformers.generate`` (the reference, not tidal's engine) from the
rows' rendered prompts, with the images through ``tidal.data.vision``'s processor: the same token
expansion and pixels the trainers see.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

COLOURS = {"red": (200, 30, 30), "green": (30, 180, 40), "blue": (30, 50, 210)}
QUESTION = "What colour is the square?"


@dataclass
class ColourTask:
    size: int = 28  # pixels per side: 28 is one image token for tidal.testing's tiny VLM
    seed: int = 0

    def draw(self, colour: str, rng: random.Random):
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (self.size, self.size), (128, 128, 128))
        side = rng.randint(self.size // 3, self.size * 2 // 3)
        x, y = rng.randint(0, self.size - side), rng.randint(0, self.size - side)
        shade = [min(255, max(0, c + rng.randint(-25, 25))) for c in COLOURS[colour]]
        ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=tuple(shade))
        return image

    def rows(self, folder: Path, n: int, with_images: bool = True, offset: int = 0) -> list[dict]:
        """``n`` rows (balanced colours), their PNGs written under ``folder/images``."""
        rng = random.Random(self.seed * 100_003 + offset)
        (folder / "images").mkdir(parents=True, exist_ok=True)
        rows = []
        for i in range(n):
            colour = list(COLOURS)[(i + offset) % len(COLOURS)]
            content: list[dict] = [{"type": "text", "text": QUESTION}]
            row: dict = {"answer": colour}
            if with_images:
                name = f"images/{offset + i:05d}.png"
                self.draw(colour, rng).save(folder / name)
                content.insert(0, {"type": "image"})
                row["images"] = [name]
            row["prompt"] = [{"role": "user", "content": content}]
            rows.append(row)
        rng.shuffle(rows)
        return rows

    def write_jsonl(self, path: str | Path, n: int, with_images: bool = True, offset: int = 0) -> Path:
        path = Path(path)
        rows = self.rows(path.parent, n, with_images, offset)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path


def greedy_answers(
    model_dir: str | Path, rows: list[dict], folder: Path, max_new_tokens: int = 4
) -> list[str]:
    """The model's greedy answer to each row (``transformers.generate``, one row at a time)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tidal.data.images import image_ref, open_image
    from tidal.data.vision import expand_image_tokens, load_vision_processor
    from tidal.models import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    processor = load_vision_processor(str(model_dir), tokenizer)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir)).eval()
    answers = []
    for row in rows:
        text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        images = [open_image(image_ref(v, folder)) for v in row.get("images", [])]
        ids, _ = expand_image_tokens(
            ids, [0] * len(ids), processor.token_counts(images), processor.image_token_id
        )
        input_ids = torch.tensor([ids])
        kwargs = processor.pixel_inputs(images) if images else {}
        kwargs["mm_token_type_ids"] = (input_ids == processor.image_token_id).int()  # M-RoPE positions
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                max_new_tokens=max_new_tokens, **kwargs,
            )  # fmt: skip
        answers.append(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True).strip())
    return answers

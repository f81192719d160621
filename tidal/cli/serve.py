"""``tidal serve`` / ``python -m tidal.cli.serve``: an OpenAI-compatible endpoint on tidal's engine.

    tidal serve --pretrain MODEL --host 127.0.0.1 --port 8000
    openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-").chat.completions.create(...)

Routes and the supported request fields are in ``tidal.serve`` (docs/recipes.md, "OpenAI-compatible
endpoint"). Needs the ``serve`` extra: ``pip install 'tidal[serve]'``.
"""

from __future__ import annotations

import argparse

from tidal.cli.common import make_parser, module_main, run_command
from tidal.config import ConfigError, ModelConfig
from tidal.config.args import configs_from_args
from tidal.config.serve import UNUSED_MODEL_FLAGS, ServeConfig

GROUPS = [(ModelConfig, "model", UNUSED_MODEL_FLAGS), (ServeConfig, "server")]


def build_parser(prog: str = "tidal serve") -> argparse.ArgumentParser:
    return make_parser(
        prog, "Serve a model with the OpenAI API: /v1/models, /v1/chat/completions, /v1/completions.", GROUPS
    )


def parse_configs(argv: list[str]) -> tuple[ModelConfig, ServeConfig]:
    """Flags → (model, server) configs, every flag checked (for scripts and tests)."""
    return _configs(build_parser().parse_args(argv))


def _configs(ns: argparse.Namespace) -> tuple[ModelConfig, ServeConfig]:
    configs = configs_from_args({"model": ModelConfig, "serve": ServeConfig}, ns)
    return configs["model"], configs["serve"]


def build_server(model: ModelConfig, serve: ServeConfig):
    """Load the model into the engine and wrap it in a (not yet started) ``OpenAIServer``."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"tidal serve needs the 'serve' extra: pip install 'tidal[serve]' ({err})") from err
    from tidal.models import load_tokenizer
    from tidal.rollout import make_engine
    from tidal.serve.server import OpenAIServer

    tokenizer = load_tokenizer(model.pretrain, model)
    try:
        engine = make_engine(model.pretrain, serve.engine_config(model), tokenizer=tokenizer)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(
            f"--pretrain {model.pretrain}: cannot load it into the rollout engine ({err})"
        ) from err
    return OpenAIServer(
        engine,
        serve.model_name(model),
        host=serve.host,
        port=serve.port,
        default_max_tokens=serve.default_max_tokens,
        log_level="info",
        limits=serve.limits,
    )


def run_from_args(ns: argparse.Namespace) -> None:
    server = build_server(*_configs(ns))
    server.serve_forever()  # uvicorn handles Ctrl-C / SIGTERM: stops accepting, then returns


def main(argv: list[str] | None = None, prog: str = "tidal serve"):
    return run_command(build_parser(prog), argv, run_from_args)


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.serve"))

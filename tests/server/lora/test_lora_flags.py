"""vLLM's LoRA flags: ``--lora-modules`` in both its forms (several values, the flag repeated)
building the engine's ``LoRAConfig``; every LoRA flag needing ``--enable-lora``; bad values
exit 2 naming what is wrong; the LoRA flags paged-serve does not implement are refused."""

from __future__ import annotations

import json

import pytest

from paged_serve.engine.engine_args import engine_kwargs
from paged_serve.engine.lora.config import LoRAConfig, LoRAModule
from paged_serve.server.cli import build_parser, main


def _lora(argv: list[str]) -> LoRAConfig | None:
    return engine_kwargs(build_parser().parse_args(argv))["lora"]


def test_without_enable_lora_there_is_no_lora_config() -> None:
    assert _lora([]) is None


def test_both_lora_modules_forms_and_the_sizes() -> None:
    described = json.dumps({"name": "b", "path": "/adapters/b", "base_model_name": "org/base"})
    config = _lora(
        [
            "--enable-lora",
            "--lora-modules", "a=/adapters/a", described,
            "--lora-modules", '{"name": "c", "path": "/adapters/c"}',
            "--max-loras", "3",
            "--max-lora-rank", "64",
            "--max-cpu-loras", "5",
        ]
    )  # fmt: skip
    assert config == LoRAConfig(
        max_loras=3,
        max_lora_rank=64,
        max_cpu_loras=5,
        modules=(
            LoRAModule("a", "/adapters/a"),
            LoRAModule("b", "/adapters/b", "org/base"),
            LoRAModule("c", "/adapters/c"),
        ),
    )


def test_enable_lora_alone_takes_the_defaults() -> None:
    assert _lora(["--enable-lora"]) == LoRAConfig()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--max-loras", "2", "--max-lora-rank", "8"], "--max-loras, --max-lora-rank needs"),
        (["--max-cpu-loras", "4"], "--max-cpu-loras needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "no-path"], "neither name=path nor a JSON object"),
        (["--enable-lora", "--lora-modules", "=/x"], "neither name=path"),
        (["--enable-lora", "--lora-modules", "{nope"], "is not JSON"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "non-empty string name and path"),
        (
            ["--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "rank": 8}'],
            "unknown key(s) ['rank']",
        ),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names an adapter twice"),
        (["--enable-lora", "--max-loras", "0"], "max_loras must be >= 1"),
        (["--enable-lora", "--max-lora-rank", "1024"], "max_lora_rank must be in [1, 512]"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras (2)"),
        (["--enable-lora", "--fully-sharded-loras"], "--fully-sharded-loras is not supported"),
        (["--enable-lora", "--lora-dtype", "float16"], "--lora-dtype float16 is not supported"),
    ],
)
def test_bad_lora_flags_exit_2(argv: list[str], needle: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert needle in capsys.readouterr().err


def test_lora_dtype_auto_is_accepted() -> None:
    assert _lora(["--enable-lora", "--lora-dtype", "auto"]) == LoRAConfig()

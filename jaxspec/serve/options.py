"""How the server answers requests (vLLM's flags): the chat template, the largest logprobs a request may ask for,
automatic tool calling."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from jaxspec.sampling_params import MAX_LOGPROBS
from jaxspec.serve.tools import TOOL_CALL_PARSERS

DEFAULT_MAX_LOGPROBS = 20   # vLLM's default


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    chat_template: str | None = None        # a Jinja template replacing the tokenizer's (the text, not a path)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS   # logprobs / top_logprobs / prompt_logprobs above it are refused
    enable_auto_tool_choice: bool = False   # tool_choice "auto" (the default with tools) is served ...
    tool_call_parser: str | None = None     # ... by this parser
    lora_modules: tuple = ()                # (name, PEFT directory) of each adapter served from the start

    def __post_init__(self):
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} (--max-logprobs) is invalid; give an int in "
                             f"[0, {MAX_LOGPROBS}] (the most the engine returns per token)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} (--tool-call-parser) is unknown; valid: "
                             f"{list(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) needs a tool_call_parser "
                             "(--tool-call-parser), the parser that finds the calls in the model's text: one of "
                             f"{list(TOOL_CALL_PARSERS)}")

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser that serves tool_choice "auto", or None when "auto" is refused."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


def load_chat_template(value: str) -> str:
    """--chat-template: a file's path, or the template itself (as vLLM: text with Jinja markup is a template;
    anything else must be a file). A ValueError says which."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:   # a template too long to be a path
        pass
    if any(mark in value for mark in ("{{", "{%", "{#")):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template (no {{{{ or {{% in it)")


def add_serve_args(p: argparse.ArgumentParser):
    """The flags of ServeOptions (vLLM's names)."""
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) replacing the model's own")
    p.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                   help=f"the most logprobs, top_logprobs or prompt_logprobs a request may ask for (0..{MAX_LOGPROBS})")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default when a request gives tools): the model decides '
                        "whether to call one, and --tool-call-parser finds the calls in its text")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="--enable-lora: LoRA adapters (PEFT directories) served under their names: a request's "
                        "`model` picks one")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how tool calls are written in the model's text: hermes (<tool_call>{...}</tool_call>, "
                        "Qwen2.5's and Hermes' templates)")


def options_from_args(args) -> ServeOptions:
    """ServeOptions of parsed flags; a ValueError names the bad one."""
    template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    modules = []
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r} is invalid; give NAME=PATH (a PEFT adapter directory)")
        modules.append((name, path))
    if modules and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    return ServeOptions(chat_template=template, max_logprobs=args.max_logprobs,
                        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                        lora_modules=tuple(modules))

